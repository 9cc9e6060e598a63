"""Sampling in two launches: the next token of each row of logits, as the PyTorch sampler draws it.

Why: engine/sampler.py makes ~20 tensor ops over the vocabulary a step (softmaxes, a top-256
sort for top-p, the counter-based hash and log of every token), each a kernel launch and a trip
through the host. Here nothing is sorted. First the row over many programs (_chunk_kernel, one
per CHUNK tokens): each chunk's max and sum of exp(l - max), and its own k largest logits (its
LOCAL_CAP largest for a top-p row without top-k) copied out with their ids, ties kept, found by a
radix select (the largest key K with at least k keys at or above it, K an ordered bit pattern of
the float: four passes of 8-bit digit histograms). No chunk's k-th largest exceeds the row's, so
the copies hold the row's whole top-k; for top-p, every token at or above the largest chunk
threshold is a candidate, so the candidates hold the nucleus when those tokens hold top_p of the
row's mass (from the chunks' sums). Then a program per row (_sample_kernel) reads those
candidates (1,536 at the default vocabulary) instead of the row: top-k's threshold among them;
e = exp(l - max) over the kept tokens (the max token always survives, so each stage's softmax is e
over its kept sum); top-p as the smallest key K of e whose tokens above it hold less than top_p of
the mass (bisection), a token kept while the mass above it is < top_p; min-p; then the argmax of
p / -log(u), u from splitmix64 of (seed, step, token) exactly as sampler.hashed_uniform. Rows the
candidates do not serve (top-k over LOCAL_CAP, a chunk's copy cut short by ties, min-p or
temperature alone, a flat nucleus) take the same passes over the whole row, with the tokens top-k
keeps copied out when they fit in CAP. On an H200 (2026-11-30) the
one-program-a-row version took ~350 us a step at the CLI's filters: six passes over 49,152 tokens
from one SM. The tokens equal the reference's except where two candidates' scores (or a token at a
top-p boundary) tie to rounding. Temperature 0: the argmax of the logits, from the chunks' maxes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .launch import cdiv, next_power_of_2

BLOCK = 4096  # tokens a program handles per step of a pass (H200, 2026-11-30, 8 warps: 353 / 1,007 / 305 us at
# top-k 40 + top-p / top-p / top-k over 49,152 tokens from one program a row, against 373 / 1,234 / 342 with 2,048)
CAP = 256  # the tokens top-k keeps that the later passes read from a copy (more, with ties: they read the row)
CHUNK = 2048  # tokens of a row a _chunk_kernel program reads (the row over many programs, not one)
LOCAL_CAP = 64  # candidates a chunk copies out: its top-k for k <= 64, its 64 largest for top-p rows


@triton.jit
def _key(x):
    """fp32 -> int32 whose signed order is the floats' order, -0.0 and +0.0 one key (equal floats:
    the reference's top-k keeps both where either is its k-th largest)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _scaled(x_ptr, offs, V, t):
    ok = offs < V
    return tl.where(ok, tl.load(x_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) / t, float("-inf")), ok


@triton.jit
def _block(x_row, start, V, lanes):
    """The logits of one block of the row as stored (-inf past V). The passes over the whole row
    load block i + 1 before working on block i, so that each block's trip to memory overlaps
    the work on the one before instead of following it."""
    return tl.load(x_row + start + lanes, mask=start + lanes < V, other=float("-inf"))


@triton.jit
def _top_k_e(v, ok, mx, floor_key):
    """exp(l - max) of the tokens top-k keeps (key >= floor_key, finite), 0 elsewhere."""
    return tl.where(ok & (_key(v).to(tl.int64) >= floor_key) & (v > float("-inf")), tl.exp(v - mx), 0.0)


@triton.jit
def _top_p_min_p_e(e, e_floor, kept_sum, min_p):
    """e of the tokens top-p keeps (key >= e_floor) whose p = e / kept_sum >= min_p * p(max), 0 elsewhere."""
    return tl.where((_key(e).to(tl.int64) >= e_floor) & (e / kept_sum >= min_p * (1.0 / kept_sum)), e, 0.0)


@triton.jit
def _hash_uniform(seed, step, idx):
    """sampler.hashed_uniform for (seed, step, token idx): splitmix64, the top 24 bits, fp64."""
    m1 = tl.full([], 0x9E3779B97F4A7C15, tl.uint64)
    m2 = tl.full([], 0xBF58476D1CE4E5B9, tl.uint64)
    m3 = tl.full([], 0x94D049BB133111EB, tl.uint64)
    x = (seed * m1) ^ (step * m2 + idx.to(tl.uint64))
    x = x * m1
    x = (x ^ (x >> 30)) * m2
    x = (x ^ (x >> 27)) * m3
    x = x ^ (x >> 31)
    return ((x >> 40).to(tl.float64) + 0.5) / 16777216.0


@triton.jit
def _kth_largest_key(x_row, V, t, k, lanes, BLOCK: tl.constexpr):
    """The k-th largest key of the row (the largest K with >= k keys at or above it): a radix
    select, four passes of 8-bit digits from the top (a histogram of the digits under the prefix
    found so far) where a bisection took 32 passes."""
    bins = tl.arange(0, 512)
    prefix = tl.full([], 0, tl.int64)  # the key + 2^31 (an unsigned order), its top digits found so far
    need = k.to(tl.int32)  # how many of the keys under the prefix are still to be passed
    for j in tl.static_range(4):
        shift = 24 - 8 * j
        hist = tl.zeros([512], tl.int32)
        raw = _block(x_row, 0, V, lanes)
        for start in range(0, V, BLOCK):
            ok = start + lanes < V
            v, raw = raw.to(tl.float32) / t, _block(x_row, start + BLOCK, V, lanes)
            u = _key(v).to(tl.int64) + 2147483648
            match = ok & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(tl.where(match, (u >> shift) & 255, 256).to(tl.int32), 512)  # 256: not under the prefix
        hist = tl.where(bins < 256, hist, 0)
        above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # keys under the prefix in higher digits
        digit = tl.max(tl.where(above + hist >= need, bins, -1), axis=0)
        need -= tl.sum(tl.where(bins == digit, above, 0), axis=0)
        prefix += digit.to(tl.int64) << shift
    return prefix - 2147483648


@triton.jit
def _copy_kept(x_row, V, t, floor_key, cx_row, ci_row, lanes, id_base, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Copy the logits with key >= floor_key (and above -inf) and their ids (id_base + position),
    ids ascending, while they fit in CAP; returns how many there are (more than CAP: the copy is
    incomplete)."""
    n_cand = tl.full([], 0, tl.int32)
    raw = _block(x_row, 0, V, lanes)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        ok = offs < V
        this, raw = raw, _block(x_row, start + BLOCK, V, lanes)
        v = this.to(tl.float32) / t
        kept = ok & (_key(v).to(tl.int64) >= floor_key) & (v > float("-inf"))
        pos = n_cand + tl.cumsum(kept.to(tl.int32), axis=0) - 1
        fits = kept & (pos < CAP)
        tl.store(cx_row + pos, this, mask=fits)
        tl.store(ci_row + pos, id_base + offs, mask=fits)
        n_cand += tl.sum(kept.to(tl.int32), axis=0)
    tl.debug_barrier()  # the copies visible to every thread of the program
    return n_cand


@triton.jit
def _tokens(ci_row, offs, ok, use_cand):
    """Token ids at positions offs: the candidate list's, or the positions themselves (the row)."""
    return tl.where(use_cand, tl.load(ci_row + offs, mask=ok & use_cand, other=0), offs)


@triton.jit
def _chunk_kernel(x_ptr, t_ptr, k_ptr, p_ptr, cand_x_ptr, cand_i_ptr, st_m_ptr, st_s_ptr, st_thr_ptr, st_n_ptr, V, stride_x, P,
                  CHUNK: tl.constexpr, LOCAL_CAP: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk of CHUNK tokens), in parallel over the row: the chunk's max and sum of
    exp(l - max) (at the row's temperature), and the tokens that could be in the row's top-k: its
    own k largest (the LOCAL_CAP largest for a top-p row without top-k), ties included, copied out
    with their ids while they fit in LOCAL_CAP (the rest of its slots -inf); a greedy row's chunk
    max and its first index instead. The row's candidates hold every token of its top-k, since no
    chunk's k-th largest exceeds the row's."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    start = c * CHUNK
    n = tl.minimum(V - start, CHUNK)
    x_chunk = x_ptr + row.to(tl.int64) * stride_x + start
    st = row * P + c
    lanes = tl.arange(0, CHUNK)
    t = tl.load(t_ptr + row)
    raw = tl.load(x_chunk + lanes, mask=lanes < n, other=float("-inf")).to(tl.float32)
    if t == 0.0:  # greedy: the chunk's max and its first index
        m = tl.max(raw, axis=0)
        tl.store(st_m_ptr + st, m)
        tl.store(st_n_ptr + st, start + tl.argmax(raw, axis=0))
        return
    v = raw / t
    m = tl.max(v, axis=0)
    tl.store(st_m_ptr + st, m)
    tl.store(st_s_ptr + st, tl.sum(tl.where(v > float("-inf"), tl.exp(v - m), 0.0), axis=0))
    k = tl.load(k_ptr + row)
    top_p = tl.load(p_ptr + row)
    top_k = (k > 0) & (k < V)
    if (top_k & (k <= LOCAL_CAP)) | ((top_k == 0) & (top_p < 1.0)):  # else the row is sampled from the whole row
        local_k = tl.where(top_k, k, LOCAL_CAP)
        thr = _kth_largest_key(x_chunk, n, t, local_k, lanes, CHUNK)
        cx, ci = cand_x_ptr + st.to(tl.int64) * LOCAL_CAP, cand_i_ptr + st.to(tl.int64) * LOCAL_CAP
        count = _copy_kept(x_chunk, n, t, thr, cx, ci, lanes, start, CHUNK, LOCAL_CAP)
        slots = tl.arange(0, LOCAL_CAP)
        tl.store(cx + slots, tl.full([LOCAL_CAP], float("-inf"), tl.float32).to(cx.dtype.element_ty), mask=slots >= count)
        tl.store(ci + slots, tl.zeros([LOCAL_CAP], tl.int32), mask=slots >= count)
        tl.store(st_thr_ptr + st, thr)
        tl.store(st_n_ptr + st, count)
    else:
        tl.store(st_n_ptr + st, LOCAL_CAP + 1)  # (no candidates)


@triton.jit
def _sample_kernel(x_ptr, t_ptr, k_ptr, p_ptr, mp_ptr, seed_ptr, step_ptr, out_ptr, cx_ptr, ci_ptr, cand_x_ptr, cand_i_ptr,
                   st_m_ptr, st_s_ptr, st_thr_ptr, st_n_ptr, V, stride_x, P,
                   BLOCK: tl.constexpr, CAP: tl.constexpr, LOCAL_CAP: tl.constexpr, P_PAD: tl.constexpr, PDL: tl.constexpr):
    """Program per row, after _chunk_kernel: the row's max (and a greedy row's token) from the
    chunks' maxes; the passes over the chunks' candidates where they hold what the filters keep
    (top-k within LOCAL_CAP and no chunk's copy cut short; a top-p row's candidates above the
    largest chunk threshold holding top_p of the mass); else over the row, as in the module note."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    t = tl.load(t_ptr + row)
    lanes = tl.arange(0, BLOCK)
    chunks = tl.arange(0, P_PAD)
    st = row * P + chunks
    m_c = tl.load(st_m_ptr + st, mask=chunks < P, other=float("-inf"))
    mx = tl.max(m_c, axis=0)
    if t == 0.0:  # greedy: the first maximal logit, from the first chunk holding the max
        first = tl.min(tl.where(m_c == mx, chunks, P_PAD), axis=0)
        arg = tl.sum(tl.where(chunks == first, tl.load(st_n_ptr + st, mask=chunks < P, other=0), 0), axis=0)
        tl.store(out_ptr + row, arg.to(tl.int64))
        return
    k = tl.load(k_ptr + row)
    top_p = tl.load(p_ptr + row)
    top_k = (k > 0) & (k < V)
    # the chunks' candidates: the row's total mass from the chunks' sums, whether every copy fit
    s_c = tl.load(st_s_ptr + st, mask=chunks < P, other=0.0)
    total_row = tl.sum(tl.where(m_c > float("-inf"), s_c * tl.exp(m_c - mx), 0.0), axis=0)
    fits = tl.max(tl.load(st_n_ptr + st, mask=chunks < P, other=0), axis=0) <= LOCAL_CAP
    n_all = P * LOCAL_CAP
    cand_x_row, cand_i_row = cand_x_ptr + row.to(tl.int64) * n_all, cand_i_ptr + row.to(tl.int64) * n_all
    use_chunks = fits & ((top_k & (k <= LOCAL_CAP)) | ((top_k == 0) & (top_p < 1.0)))
    if use_chunks & (top_k == 0):  # top-p: every token at or above the largest chunk threshold is a candidate
        t_star = tl.max(tl.load(st_thr_ptr + st, mask=chunks < P, other=-2147483648), axis=0)
        held = 0.0
        for start in range(0, n_all, BLOCK):
            v, ok = _scaled(cand_x_row, start + lanes, n_all, t)
            held += tl.sum(tl.where(ok & (_key(v).to(tl.int64) >= t_star) & (v > float("-inf")), tl.exp(v - mx), 0.0), axis=0)
        use_chunks = held >= top_p * total_row
    floor_key = tl.full([], -2147483648, tl.int64)
    if use_chunks:
        use_cand = n_all > 0
        src, ci_row, n = cand_x_row, cand_i_row, n_all
        total = total_row
        if top_k:
            floor_key = _kth_largest_key(cand_x_row, n_all, t, k, lanes, BLOCK)
            total = 0.0
            for start in range(0, n_all, BLOCK):
                v, ok = _scaled(cand_x_row, start + lanes, n_all, t)
                total += tl.sum(_top_k_e(v, ok, mx, floor_key), axis=0)
    else:
        # the whole row: top-k's threshold (the largest key K with >= k logits at or above it) and
        # the tokens it keeps copied out (ids ascending) while they fit in CAP, so that the later
        # passes read those few. (A top-p row here has a nucleus past the chunks' candidates, or
        # ties that overflowed a chunk's copy: it reads the row.)
        cx_row, ci_row = cx_ptr + row.to(tl.int64) * CAP, ci_ptr + row.to(tl.int64) * CAP
        n_cand = tl.full([], 0, tl.int32)
        if top_k:
            floor_key = _kth_largest_key(x_row, V, t, k, lanes, BLOCK)
            n_cand = _copy_kept(x_row, V, t, floor_key, cx_row, ci_row, lanes, 0, BLOCK, CAP)
        use_cand = (n_cand > 0) & (n_cand <= CAP)
        src = tl.where(use_cand, cx_row, x_row)
        n = tl.where(use_cand, n_cand, V)
        total = 0.0
        for start in range(0, n, BLOCK):
            v, ok = _scaled(src, start + lanes, n, t)
            total += tl.sum(_top_k_e(v, ok, mx, floor_key), axis=0)
    # top-p: the smallest key K of e whose tokens above it hold < top_p of the kept mass
    e_floor = tl.full([], -1, tl.int64)  # keep e with key >= e_floor (e >= 0: every key >= 0)
    if top_p < 1.0:
        target = top_p * total
        lo, hi = tl.full([], -1, tl.int64), tl.full([], 2147483647, tl.int64)  # mass above lo >= target > mass above hi
        for _ in range(32):
            if hi - lo > 1:
                mid = lo + (hi - lo) // 2
                above = 0.0
                for start in range(0, n, BLOCK):
                    v, ok = _scaled(src, start + lanes, n, t)
                    e = _top_k_e(v, ok, mx, floor_key)
                    above += tl.sum(tl.where(_key(e).to(tl.int64) > mid, e, 0.0), axis=0)
                if above < target:
                    hi = mid
                else:
                    lo = mid
        e_floor = hi
    # min-p, over what top-k and top-p kept
    kept_sum = 0.0
    for start in range(0, n, BLOCK):
        v, ok = _scaled(src, start + lanes, n, t)
        e = _top_k_e(v, ok, mx, floor_key)
        kept_sum += tl.sum(tl.where(_key(e).to(tl.int64) >= e_floor, e, 0.0), axis=0)
    min_p = tl.load(mp_ptr + row)  # kept while p >= min_p * p(max), p = e / kept_sum (the max token's e is 1)
    final_sum = 0.0
    for start in range(0, n, BLOCK):
        v, ok = _scaled(src, start + lanes, n, t)
        e = _top_k_e(v, ok, mx, floor_key)
        e = _top_p_min_p_e(e, e_floor, kept_sum, min_p)
        final_sum += tl.sum(e, axis=0)
    seed = tl.load(seed_ptr + row).to(tl.uint64)
    step = tl.load(step_ptr + row).to(tl.uint64)
    best, arg = tl.full([], -1.0, tl.float32), tl.full([], 0, tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        v, ok = _scaled(src, offs, n, t)
        e = _top_k_e(v, ok, mx, floor_key)
        e = _top_p_min_p_e(e, e_floor, kept_sum, min_p)
        token = _tokens(ci_row, offs, ok, use_cand)
        noise = (-tl.log(_hash_uniform(seed, step, token))).to(tl.float32)
        s = tl.where(e > 0.0, (e / final_sum) / noise, -1.0)
        m = tl.max(s, axis=0)
        if m > best:
            best, arg = m, tl.sum(tl.where(lanes == tl.argmax(s, axis=0), token, 0), axis=0)
    tl.store(out_ptr + row, arg.to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The next token of each row of logits [B, V] (penalties applied): sampler.sample's draw."""
    B, V = logits.shape
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        t, k, p = temperature.float().contiguous(), top_k.long().contiguous(), top_p.float().contiguous()
        P = cdiv(V, CHUNK)
        cand_x = torch.empty(B, P * LOCAL_CAP, dtype=x.dtype, device=x.device)
        cand_i = torch.empty(B, P * LOCAL_CAP, dtype=torch.int32, device=x.device)
        st_m, st_s = torch.empty(B, P, dtype=torch.float32, device=x.device), torch.empty(B, P, dtype=torch.float32, device=x.device)
        st_thr, st_n = torch.empty(B, P, dtype=torch.int64, device=x.device), torch.empty(B, P, dtype=torch.int32, device=x.device)
        stats = (st_m, st_s, st_thr, st_n)
        _chunk_kernel[(B, P)](x, t, k, p, cand_x, cand_i, *stats, V, x.stride(0), P, CHUNK=CHUNK, LOCAL_CAP=LOCAL_CAP, num_warps=8,
                              **pdl.launch_args(x))
        cx, ci = torch.empty(B, CAP, dtype=x.dtype, device=x.device), torch.empty(B, CAP, dtype=torch.int32, device=x.device)
        rest = (min_p.float().contiguous(), seeds.long().contiguous(), steps.long().contiguous())
        _sample_kernel[(B,)](x, t, k, p, *rest, out, cx, ci, cand_x, cand_i, *stats, V, x.stride(0), P, BLOCK=BLOCK, CAP=CAP,
                             LOCAL_CAP=LOCAL_CAP, P_PAD=max(2, next_power_of_2(P)), num_warps=8, **pdl.launch_args(x))
    return out
