"""Sampling in one launch: the next token of each row of logits, as the PyTorch sampler draws it.

Why: engine/sampler.py makes ~20 tensor ops over the vocabulary a step (softmaxes, a top-256
sort for top-p, the counter-based hash and log of every token), each a kernel launch and a trip
through the host. One program per row here does the same in passes over the row, with nothing
sorted: temperature and the max; top-k as a threshold (the largest key K with at least k logits
at or above it, K an ordered bit pattern of the float, so ties are kept as the reference keeps
them), found by a radix select: four passes of 8-bit digit histograms; the tokens top-k keeps,
when they fit in CAP, copied out so that every later pass reads those few, not the vocabulary
(at the CLI's top-k 40: 6 passes over the row instead of ~70; top-p alone: the CAP largest, used
when they hold top_p of the mass); e = exp(l - max) over the kept
tokens (the max token always survives, so each stage's softmax is e over its kept sum); top-p as
the smallest key K whose tokens above it hold less than top_p of the mass (bisection), a token
kept while the mass above it is < top_p; min-p; then the argmax of p / -log(u), u from splitmix64
of (seed, step, token) exactly as sampler.hashed_uniform. The tokens equal the reference's except
where two candidates' scores (or a token at a top-p boundary) tie to rounding. Temperature 0: the
argmax of the logits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

BLOCK = 4096  # tokens a program handles per step of a pass (H200, 2026-11-30, 8 warps: 353 / 1,007 / 305 us at
# top-k 40 + top-p / top-p / top-k over 49,152 tokens, against 373 / 1,234 / 342 with 2,048: benchmarks/gpu_sampler_sweep.py)
CAP = 256  # the tokens top-k keeps that the later passes read from a copy (more, with ties: they read the row)


@triton.jit
def _key(x):
    """fp32 -> int32 whose signed order is the floats' order."""
    b = x.to(tl.int32, bitcast=True)
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
def _copy_kept(x_row, V, t, floor_key, cx_row, ci_row, lanes, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Copy the logits with key >= floor_key (and above -inf) and their ids, ids ascending, while
    they fit in CAP; returns how many there are (more than CAP: the copy is incomplete)."""
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
        tl.store(ci_row + pos, offs, mask=fits)
        n_cand += tl.sum(kept.to(tl.int32), axis=0)
    tl.debug_barrier()  # the copies visible to every thread of the program
    return n_cand


@triton.jit
def _tokens(ci_row, offs, ok, use_cand):
    """Token ids at positions offs: the candidate list's, or the positions themselves (the row)."""
    return tl.where(use_cand, tl.load(ci_row + offs, mask=ok & use_cand, other=0), offs)


@triton.jit
def _sample_kernel(x_ptr, t_ptr, k_ptr, p_ptr, mp_ptr, seed_ptr, step_ptr, out_ptr, cx_ptr, ci_ptr, V, stride_x,
                   BLOCK: tl.constexpr, CAP: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_prior(PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    t = tl.load(t_ptr + row)
    lanes = tl.arange(0, BLOCK)
    if t == 0.0:  # greedy: the first maximal logit
        best, arg = tl.full([], float("-inf"), tl.float32), tl.full([], 0, tl.int32)
        raw = _block(x_row, 0, V, lanes)
        for start in range(0, V, BLOCK):
            v, raw = raw.to(tl.float32), _block(x_row, start + BLOCK, V, lanes)
            m = tl.max(v, axis=0)
            if m > best:
                best, arg = m, start + tl.argmax(v, axis=0)
        tl.store(out_ptr + row, arg.to(tl.int64))
        return
    mx = tl.full([], float("-inf"), tl.float32)
    raw = _block(x_row, 0, V, lanes)
    for start in range(0, V, BLOCK):
        v, raw = raw.to(tl.float32) / t, _block(x_row, start + BLOCK, V, lanes)
        mx = tl.maximum(mx, tl.max(v, axis=0))
    # top-k: the largest key K with >= k logits at or above it (keys of -inf and below count all),
    # and the tokens it keeps copied out (ids ascending) while they fit in CAP: then every later
    # pass reads those few instead of the vocabulary. Without top-k but with top-p, the CAP largest
    # logits are copied: a superset of top-p's nucleus whenever they hold top_p of the mass
    k = tl.load(k_ptr + row)
    top_p = tl.load(p_ptr + row)
    floor_key = tl.full([], -2147483648, tl.int64)
    cx_row, ci_row = cx_ptr + row.to(tl.int64) * CAP, ci_ptr + row.to(tl.int64) * CAP
    n_cand = tl.full([], 0, tl.int32)
    nucleus = tl.full([], 0, tl.int32)  # 1: the copy is the CAP largest, not all that top-k keeps
    if k > 0 and k < V:
        floor_key = _kth_largest_key(x_row, V, t, k, lanes, BLOCK)
        n_cand = _copy_kept(x_row, V, t, floor_key, cx_row, ci_row, lanes, BLOCK, CAP)
    elif top_p < 1.0 and CAP < V:
        n_cand = _copy_kept(x_row, V, t, _kth_largest_key(x_row, V, t, tl.full([], CAP, tl.int64), lanes, BLOCK), cx_row, ci_row, lanes, BLOCK, CAP)
        nucleus = 1
    use_cand = (n_cand > 0) & (n_cand <= CAP)
    # top-p: the smallest key K of e whose tokens above it hold < top_p of the kept mass (the kept
    # mass over the row unless the copy holds all of it)
    whole = (nucleus == 1) | (use_cand == 0)
    src = tl.where(whole, x_row, cx_row)
    n = tl.where(whole, V, n_cand)
    total = 0.0
    for start in range(0, n, BLOCK):
        v, ok = _scaled(src, start + lanes, n, t)
        total += tl.sum(_top_k_e(v, ok, mx, floor_key), axis=0)
    n_held = tl.where((nucleus == 1) & use_cand, n_cand, 0)
    held = 0.0
    for start in range(0, n_held, BLOCK):
        v, ok = _scaled(cx_row, start + lanes, n_held, t)
        held += tl.sum(_top_k_e(v, ok, mx, floor_key), axis=0)
    use_cand = use_cand & ((nucleus == 0) | (held >= top_p * total))  # else a token past the copy can be in the nucleus
    src = tl.where(use_cand, cx_row, x_row)
    n = tl.where(use_cand, n_cand, V)
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
        args = (temperature.float(), top_k.long(), top_p.float(), min_p.float(), seeds.long(), steps.long())
        cand_x, cand_i = torch.empty(B, CAP, dtype=x.dtype, device=x.device), torch.empty(B, CAP, dtype=torch.int32, device=x.device)
        _sample_kernel[(B,)](x, *(a.contiguous() for a in args), out, cand_x, cand_i, V, x.stride(0), BLOCK=BLOCK, CAP=CAP, num_warps=8,
                              **pdl.launch_args(x))
    return out
