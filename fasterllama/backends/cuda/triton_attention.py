"""Triton attention kernels for CUDA: fused RoPE + KV store, flash-decoding, varlen flash-attention prefill.

Why: the reference ops gather each sequence's cache into new tensors every step (decode copies
[B, kv_heads, L, D] out of the cache; prefill runs one SDPA call per sequence from Python). These
kernels read K/V where they lie, in one launch per op, and keep the decode path free of host syncs
so that it can be captured in a CUDA graph.

Cache layout: paged. Every kernel addresses a cache of shape [num_blocks, kv_heads, block_size,
head_dim] through `block_tables` [num_seqs, max_blocks_per_seq]: key position p of sequence s
lives in block block_tables[s, p // block_size] at offset p % block_size (the engine's
AttentionMetadata). Only head_dim has to be contiguous; every other dimension is addressed
through its stride.

Kernels take any even head_dim D in [8, 256]. They work on the head dimension padded to a power
of two of at least 16 (BLOCK_D; RoPE on each half padded to a power of two); when D is not already
that size (PADDED), loads and stores are masked with d < D and the padded lanes hold zeros, which
add nothing to the dot products. Power-of-two D from 16 up runs unmasked, as before. The op
wrappers fall back to the reference ops for other head dims.

Under TRITON_INTERPRET=1 (CPU tests) half-precision tiles are upcast to fp32 right after loading,
because the interpreter's bf16 tl.dot is wrong; on a GPU the dots stay in the input dtype.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ...ops import reference
from ...ops.metadata import AttentionMetadata
from . import pdl
from .launch import cdiv, next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634


def supports(head_dim: int) -> bool:
    """Whether the kernels take this head_dim (CUDA graphs of decode steps need them to)."""
    return 8 <= head_dim <= 256 and head_dim % 2 == 0


def _block_d(head_dim: int) -> int:
    """The head dimension the attention kernels work on: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use full-precision dots ("ieee") so results match the reference to ~1e-5."""
    return "ieee" if dtype == torch.float32 or _INTERPRET else "tf32"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1, "head_dim must be contiguous"


# -- RoPE + KV store --------------------------------------------------------------------------------


@triton.jit
def _rope_half_rounded(x1, x2, c1, c2, s1, s2, DT: tl.constexpr):
    """Rotate-half RoPE on the two halves of a head, in fp32 but rounded to DT after each op as the
    reference does (it multiplies and adds in the input dtype): bf16/fp16 results agree to the last
    bit on a GPU (the interpreter truncates instead of rounding), fp32 ones to an ulp or so."""
    o1 = (x1 * c1).to(DT).to(tl.float32) + (-(x2 * s1)).to(DT).to(tl.float32)
    o2 = (x2 * c2).to(DT).to(tl.float32) + (x1 * s2).to(DT).to(tl.float32)
    return o1.to(DT), o2.to(DT)


@triton.jit
def _rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qkv_t, stride_cos_t, stride_sin_t, stride_qo_t, stride_qo_h,
    stride_cb, stride_ch, stride_cs, block_size,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    """One program per token: rotate its q and k heads, write q out and k/v into the cache. Lane d
    of a head's first half pairs with lane d + D // 2 of the real D; BLOCK_HALF pads a half to a
    power of two, with masked lanes d >= D // 2 when that pads anything."""
    pdl.wait_prior(PDL)
    HALF: tl.constexpr = D // 2
    PADDED: tl.constexpr = BLOCK_HALF != HALF
    DT: tl.constexpr = qkv_ptr.dtype.element_ty
    CDT: tl.constexpr = k_cache_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    # cos/sin are fp32; the reference casts them to the input dtype before multiplying
    if PADDED:
        md = offs_d < HALF
        c1 = tl.load(cos_ptr + t * stride_cos_t + offs_d, mask=md, other=0).to(DT).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_cos_t + HALF + offs_d, mask=md, other=0).to(DT).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_sin_t + offs_d, mask=md, other=0).to(DT).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_sin_t + HALF + offs_d, mask=md, other=0).to(DT).to(tl.float32)
    else:
        c1 = tl.load(cos_ptr + t * stride_cos_t + offs_d).to(DT).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_cos_t + HALF + offs_d).to(DT).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_sin_t + offs_d).to(DT).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_sin_t + HALF + offs_d).to(DT).to(tl.float32)
    row = qkv_ptr + t * stride_qkv_t
    slot = tl.load(slot_ptr + t)
    # every load before any arithmetic (one trip to memory, not one after another): the row's q, k
    # and v heads whatever the slot (the row is there; only the stores skip a padding row)
    hq = tl.arange(0, BLOCK_HQ)
    mq = (hq < H)[:, None]
    hk = tl.arange(0, BLOCK_HK)
    mh = (hk < KVH)[:, None]
    if PADDED:
        mq = mq & md[None, :]
        mh = mh & md[None, :]
    xq = row + hq[:, None] * D + offs_d[None, :]
    q1, q2 = tl.load(xq, mask=mq, other=0), tl.load(xq + HALF, mask=mq, other=0)
    xk = row + (H + hk[:, None]) * D + offs_d[None, :]
    k1, k2 = tl.load(xk, mask=mh, other=0), tl.load(xk + HALF, mask=mh, other=0)
    v1, v2 = tl.load(xk + KVH * D, mask=mh, other=0), tl.load(xk + KVH * D + HALF, mask=mh, other=0)

    o1, o2 = _rope_half_rounded(q1.to(tl.float32), q2.to(tl.float32), c1[None, :], c2[None, :], s1[None, :], s2[None, :], DT)
    q_out = q_out_ptr + t * stride_qo_t + hq[:, None] * stride_qo_h + offs_d[None, :]
    tl.store(q_out, o1, mask=mq)
    tl.store(q_out + HALF, o2, mask=mq)

    mk = mh & (slot >= 0)  # slot -1: a padding row, nothing to store
    k1, k2 = _rope_half_rounded(k1.to(tl.float32), k2.to(tl.float32), c1[None, :], c2[None, :], s1[None, :], s2[None, :], DT)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + hk[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k1.to(CDT), mask=mk)
    tl.store(k_cache_ptr + dst + HALF, k2.to(CDT), mask=mk)
    tl.store(v_cache_ptr + dst, v1.to(CDT), mask=mk)
    tl.store(v_cache_ptr + dst + HALF, v2.to(CDT), mask=mk)


def rope_and_store(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
) -> torch.Tensor:
    """Rotate q and k of a fused projection qkv [T, (H + 2 KVH) * D] (rotate-half RoPE with cos/sin
    fp32 [T, D]), write k and v to the cache at flat slots slot_mapping [T] (block * block_size +
    offset; -1 skips the row) and return the rotated q [T, H, D]."""
    _check_cache(k_cache, v_cache)
    T = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and k_cache.shape[1] == num_kv_heads
    assert supports(head_dim) and k_cache.shape[3] == head_dim and cos.shape[-1] == sin.shape[-1] == head_dim
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    _rope_store_kernel[(T,)](
        qkv, cos, sin, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[2],
        H=num_heads, KVH=num_kv_heads, D=head_dim,
        BLOCK_HQ=next_power_of_2(num_heads), BLOCK_HK=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        num_warps=4 if num_heads * head_dim >= 2048 else 2, **pdl.launch_args(qkv),
    )
    return q


@triton.jit
def _rope_tables_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
                        PDL: tl.constexpr):
    """cos and sin [T, 2 HALF] of positions x inv_freq, as reference.rope_tables makes them (the
    same fp32 product; tl.cos and tl.sin are libdevice's precise cosf / sinf, as torch's kernels)."""
    inv = tl.load(inv_ptr + tl.arange(0, BLOCK_HALF), mask=tl.arange(0, BLOCK_HALF) < HALF, other=0.0)  # (no kernel writes it)
    pdl.wait_prior(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_HALF)
    ok = (t < T)[:, None] & (d < HALF)[None, :]
    freqs = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)[:, None] * inv[None, :]
    c, s = tl.cos(freqs), tl.sin(freqs)
    rows = t.to(tl.int64)[:, None] * (2 * HALF) + d[None, :]
    tl.store(cos_ptr + rows, c, mask=ok)
    tl.store(cos_ptr + rows + HALF, c, mask=ok)
    tl.store(sin_ptr + rows, s, mask=ok)
    tl.store(sin_ptr + rows + HALF, s, mask=ok)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rope_tables in one launch (five small kernels of torch's otherwise, a step's)."""
    T, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(T, 2 * half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if T:
        block_t = max(1, min(64, 4096 // next_power_of_2(half)))
        _rope_tables_kernel[(cdiv(T, block_t),)](positions, inv_freq.float().contiguous(), cos, sin, T, HALF=half, BLOCK_T=block_t,
                                                        BLOCK_HALF=next_power_of_2(half), num_warps=4, **pdl.launch_args(cos))
    return cos, sin


# -- shared attention pieces ------------------------------------------------------------------------


@triton.jit
def _load_kv(k_base, v_base, bt_row_ptr, offs_n, mask_n, offs_d, mask_d, block_size, stride_cb, stride_cs,
             MASKED: tl.constexpr, PADDED: tl.constexpr, UPCAST: tl.constexpr):
    """K and V tiles [BLOCK_N, BLOCK_D] of key positions offs_n in a paged cache, found through a
    block-table row; positions outside mask_n (MASKED) and padded head lanes (PADDED) read 0."""
    if MASKED:
        blk = tl.load(bt_row_ptr + offs_n // block_size, mask=mask_n, other=0)
    else:
        blk = tl.load(bt_row_ptr + offs_n // block_size)
    rows = (blk.to(tl.int64) * stride_cb + (offs_n % block_size).to(tl.int64) * stride_cs)[:, None] + offs_d[None, :]
    if MASKED:
        mask = mask_n[:, None]
        if PADDED:
            mask = mask & mask_d
        k = tl.load(k_base + rows, mask=mask, other=0)
        v = tl.load(v_base + rows, mask=mask, other=0)
    elif PADDED:
        k = tl.load(k_base + rows, mask=mask_d, other=0)
        v = tl.load(v_base + rows, mask=mask_d, other=0)
    else:
        k = tl.load(k_base + rows)
        v = tl.load(v_base + rows)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _softmax_step(q, k, v, s_mask, m_i, l_i, acc, qk_scale, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step (scores kept in log2 units) of query rows q [M, D] over a key tile
    k, v [N, D]; s_mask [M, N] (or None) marks visible keys. USE_DOT=False replaces the tensor-core
    dots by broadcast-multiply-sum, cheaper when M is tiny (a decode query group of 1)."""
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = s * qk_scale
    if s_mask is not None:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # probs rounded to v's dtype, as the reference does
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc * alpha[:, None] + pv


# -- decode -----------------------------------------------------------------------------------------


@triton.jit
def _split_chunk(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a sequence: its length over the splits, rounded up to whole tiles."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _rope_rows(x_ptr, x_off, cos_ptr, c_off, sin_ptr, s_off, offs_d, mask, D: tl.constexpr, DT: tl.constexpr):
    """Heads of a projection's output rotated (rotate-half RoPE, rounded as _rope_half_rounded
    rounds it), [rows, BLOCK_D] in DT: row i is the head at x_ptr + x_off[i], its angles' cos and
    sin at c_off[i] and s_off[i]; lane d meets its partner d -/+ D/2, loaded as a second tile, so
    the halves need no joining."""
    HALF: tl.constexpr = D // 2
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    x = tl.load(x_ptr + x_off[:, None] + offs_d[None, :], mask=mask, other=0).to(tl.float32)
    xp = tl.load(x_ptr + x_off[:, None] + partner[None, :], mask=mask, other=0).to(tl.float32)
    c = tl.load(cos_ptr + c_off[:, None] + offs_d[None, :], mask=mask, other=0).to(DT).to(tl.float32)
    sn = tl.load(sin_ptr + s_off[:, None] + offs_d[None, :], mask=mask, other=0).to(DT).to(tl.float32)
    turned = tl.where(first[None, :], -(xp * sn), xp * sn)
    return ((x * c).to(DT).to(tl.float32) + turned.to(DT).to(tl.float32)).to(DT)


@triton.jit
def _reads_new_token(r, b, seq_lens_ptr, slot_ptr, bt_row, lo, hi, block_size):
    """Whether row r's new token (at position seq_lens[r] - 1, slot slot_ptr[r]) is one that
    sequence b's program for keys [lo, hi) reads, r != b: where b's block table puts that position
    at r's slot (only a speculative verify step's rows of one sequence share positions so)."""
    r_ok = (r < tl.num_programs(0)) & (r != b)
    r_pos = tl.load(seq_lens_ptr + r, mask=r_ok, other=0).to(tl.int32) - 1
    r_slot = tl.load(slot_ptr + r, mask=r_ok, other=-1)
    r_in = r_ok & (r_slot >= 0) & (r_pos >= lo) & (r_pos < hi)
    r_blk = tl.load(bt_row + tl.maximum(r_pos, 0) // block_size, mask=r_in, other=-1)
    return r_in & (r_blk.to(tl.int64) * block_size + r_pos % block_size == r_slot)


@triton.jit
def _store_new_kv(qkv_ptr, cos_ptr, sin_ptr, k_base, v_base, rows, slots, mask, stride_qb, stride_cos, stride_sin, stride_cb, stride_cs,
                  block_size, K_HEAD, V_HEAD, D: tl.constexpr, DT: tl.constexpr):
    """The keys (rotated) and values of a KV head (K_HEAD, V_HEAD: their heads in a qkv row) of
    rows `rows` into the cache at `slots`, where mask."""
    r64 = rows.to(tl.int64)
    offs_d = tl.arange(0, mask.shape[1])
    k = _rope_rows(qkv_ptr, r64 * stride_qb + K_HEAD * D, cos_ptr, r64 * stride_cos, sin_ptr, r64 * stride_sin, offs_d, mask, D, DT)
    v = tl.load(qkv_ptr + (r64 * stride_qb + V_HEAD * D)[:, None] + offs_d[None, :], mask=mask, other=0)
    at = ((slots // block_size).to(tl.int64) * stride_cb + (slots % block_size).to(tl.int64) * stride_cs)[:, None] + offs_d[None, :]
    tl.store(k_base + at, k.to(k_base.dtype.element_ty), mask=mask)
    tl.store(v_base + at, v.to(v_base.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_ch, stride_cs, stride_bt, block_size,
    H: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
    cos_ptr=None, sin_ptr=None, slot_ptr=None, stride_cos=0, stride_sin=0, ROPE: tl.constexpr = False, B_PAD: tl.constexpr = 1,
):
    """Program (sequence b, KV head, split): all GROUP query heads of the KV head attend keys
    [split * chunk, (split + 1) * chunk) ∩ [0, seq_len), so each K/V tile is read once; the chunk
    follows the sequence's actual length (_split_chunk), so a short context in a large cache still
    spreads over every split. One split writes the final output; several write unnormalized
    partials for _decode_combine_kernel. (Merged inside this kernel by the last split to finish, it
    took ~4 us a call more than this kernel and the combine together, on an H200 on 2026-11-30:
    the count's GPU-scope atomic in every split and the merge after the last one's work.)
    ROPE: q_ptr is the qkv projection's output [B, (H + 2 KVH) * D] (stride_qb a row): each
    program rotates its query heads itself, and before it reads the cache it rotates and stores
    (at slot_ptr's slots, -1: none) every new key and value of the step that lies in its split and
    that it reads: its own row's, and in a speculative verify step (a row per drafted token of a
    sequence, model_runner.step_inputs) the earlier drafts' too, whose rows' programs run in no
    order (the same bits stored twice, not read before this program stores them):
    rope_and_store's launch a layer goes. B_PAD: the rows padded to a power of two."""
    pdl.wait_prior(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    chunk = _split_chunk(seq_len, NUM_SPLITS, BLOCK_N)
    lo = split * chunk
    if NUM_SPLITS > 1 and lo >= seq_len:  # nothing to attend: the combine kernel ignores this split
        return
    hi = tl.minimum(lo + chunk, seq_len)

    PADDED: tl.constexpr = BLOCK_D != D
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = (offs_d < D)[None, :]
    heads = kvh * GROUP + offs_g
    mask_g = (offs_g < GROUP)[:, None]
    if PADDED:
        mask_g = mask_g & mask_d
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh.to(tl.int64) * stride_ch
    v_base = v_cache_ptr + kvh.to(tl.int64) * stride_ch
    if ROPE:
        DT: tl.constexpr = q_ptr.dtype.element_ty
        b64 = b.to(tl.int64)
        q = _rope_rows(q_ptr, b64 * stride_qb + heads * D, cos_ptr, heads * 0 + b64 * stride_cos, sin_ptr, heads * 0 + b64 * stride_sin, offs_d,
                       mask_g, D, DT)
        slot = tl.load(slot_ptr + b)
        own = (hi == seq_len) & (slot >= 0)  # this split holds the row's new token
        if own:
            _store_new_kv(q_ptr, cos_ptr, sin_ptr, k_base, v_base, b + tl.arange(0, 1), slot + tl.arange(0, 1), (offs_d < D)[None, :], stride_qb, stride_cos,
                          stride_sin, stride_cb, stride_cs, block_size, H + kvh, H + H // GROUP + kvh, D, DT)
        # the step's other new tokens this split reads: a speculative verify step's earlier drafts
        # (row r's token at position seq_lens[r] - 1, where this sequence's block table puts that
        # position at r's slot); a [rows] pass over the step's rows, the keys made only where any is
        r = tl.arange(0, B_PAD)
        r_in = _reads_new_token(r, b, seq_lens_ptr, slot_ptr, bt_row, lo, hi, block_size)
        others = tl.max(r_in.to(tl.int32), axis=0) > 0
        if others:
            for r0 in range(0, tl.num_programs(0), 8):
                rr = r0 + tl.arange(0, 8)
                rr_in = _reads_new_token(rr, b, seq_lens_ptr, slot_ptr, bt_row, lo, hi, block_size)
                rr_slot = tl.load(slot_ptr + rr, mask=rr_in, other=0)
                _store_new_kv(q_ptr, cos_ptr, sin_ptr, k_base, v_base, rr, rr_slot, rr_in[:, None] & (offs_d < D)[None, :], stride_qb,
                              stride_cos, stride_sin, stride_cb, stride_cs, block_size, H + kvh, H + H // GROUP + kvh, D, DT)
        if own | others:
            tl.debug_barrier()  # (the stores before this program's threads read the cache; no other program reads them first)
    else:
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_g, other=0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        k, v = _load_kv(k_base, v_base, bt_row, offs_n, mask_n, offs_d, mask_d, block_size, stride_cb, stride_cs, True, PADDED, UPCAST)
        m_i, l_i, acc = _softmax_step(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, USE_DOT, PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0: zeros
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g)
    else:
        part = (b.to(tl.int64) * H + heads) * NUM_SPLITS + split  # [GROUP_PAD] rows of [B, H, NUM_SPLITS]
        tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=mask_g)
        tl.store(part_m_ptr + part, m_i, mask=offs_g < GROUP)
        tl.store(part_l_ptr + part, l_i, mask=offs_g < GROUP)


@triton.jit
def _decode_combine_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr, out_ptr, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """Program (sequence, query head): merge the splits' partials by their log-sum-exp. Only the
    splits that held keys are read; the others exited without writing."""
    pdl.wait_prior(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < tl.cdiv(seq_len, _split_chunk(seq_len, NUM_SPLITS, BLOCK_N))
    part = (b.to(tl.int64) * H + h) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + part, mask=mask_s, other=float("-inf"))
    part_l = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # seq_len 0: all weights 0
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_acc = mask_s[:, None]
    if BLOCK_D != D:
        mask_acc = mask_acc & mask_d[None, :]
    acc = tl.load(part_acc_ptr + part[:, None] * D + offs_d[None, :], mask=mask_acc, other=0.0)
    total = tl.sum(part_l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    if BLOCK_D != D:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _decode_block_n(head_dim: int, use_dot: bool, dtype: torch.dtype, programs: int, device: torch.device) -> int:
    """Keys per tile: sized so that a program stays under ~100 registers (checked with ptxas for
    sm_90), which lets several programs per SM keep enough K/V loads in flight; tiles of 32 keys
    where (sequences x KV heads) alone fill less than the chip, so that a short context still
    splits into enough programs (a 512-key context over 3 KV heads: 48 programs, not 12)."""
    if _INTERPRET:
        return 16
    if not use_dot:  # broadcast products [BLOCK_N, D] live in registers
        return max(16, min(32, 4096 // head_dim))
    if dtype == torch.float32:  # "ieee" fp32 dots run on FMA units with large register tiles
        return max(16, min(128, 2048 // head_dim))
    block_n = min(128, 8192 // head_dim)
    return min(block_n, 32) if programs < _num_sms(device.index or 0) else block_n


def _decode_splits(batch: int, kv_heads: int, max_len: int, block_n: int, device: torch.device) -> int:
    """How many splits a sequence's keys are cut into, from shapes and the cache capacity only, so
    a captured graph stays valid: enough for ~4 programs per SM with the batch's (sequence, KV
    head) pairs, at most 64 and no more than half the capacity's tiles. Each program's share follows
    the actual length at run time (_split_chunk); a batch filling the grid on its own runs one split
    and skips the combine. (On an H200, kernel + combine, `gpu_attention_sweep.py` on 2026-11-30:
    ~16 programs an SM and one tile a split took 7.1 / 13.4 µs at 7B's heads, batch 1, 512 / 2,048
    keys, against 6.4 / 12.3 for 16 splits; batch 8, 27.0 / 74.7 for 9 splits against 23.4-25.3 /
    69.9-73.5 for 2-4; the default model's heads 3.9 / 5.8 at 512 keys, batch 1 / 8, against 3.6 /
    4.5 for 16 splits.)"""
    if _INTERPRET:  # small tests: two-tile splits exercise both the split and the tile loop
        return cdiv(max_len, 2 * block_n)
    return max(1, min(64, cdiv(max_len, 2 * block_n), cdiv(4 * _num_sms(device.index or 0), batch * kv_heads)))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, max_len: int, block_n: int | None = None, num_splits: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence, q [B, H, D], over its seq_lens[b] cached keys
    (positions 0..len-1; len 0 gives zeros). max_len (the cache's capacity per sequence, a Python
    int) fixes the number of context splits, so the launch needs no host sync and can be captured
    in a CUDA graph. block_n, num_splits: the keys a tile and the splits, in place of the choice
    made from the shapes (benchmarks/gpu_attention_sweep.py times them). rope = (cos, sin,
    slot_mapping, num_heads): q is the qkv projection's output [B, (H + 2 KVH) * D], rotated and
    its key and value stored at the slots by this kernel (rope_and_store's work, in its launch)."""
    _check_cache(k_cache, v_cache)
    D = k_cache.shape[3]
    if rope is not None:
        cos, sin, slots, H = rope
        B = q.shape[0]
        assert q.stride(-1) == 1 and q.shape[1] == (H + 2 * k_cache.shape[1]) * D and cos.stride(-1) == sin.stride(-1) == 1
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
        rope_args = dict(cos_ptr=cos, sin_ptr=sin, slot_ptr=slots, stride_cos=cos.stride(0), stride_sin=sin.stride(0), ROPE=True,
                         B_PAD=next_power_of_2(B))
        stride_qb, stride_qh = q.stride(0), D
    else:
        B, H, _ = q.shape
        assert q.stride(-1) == 1 and q.shape[2] == D
        out = torch.empty_like(q)
        rope_args, stride_qb, stride_qh = {}, q.stride(0), q.stride(1)
    KVH = k_cache.shape[1]
    group = H // KVH
    assert H == group * KVH and supports(D)
    if B == 0:
        return out
    # the query heads of a KV head padded to 16 rows for tensor cores (MHA too: its lone query as a
    # broadcast-multiply-sum needed cross-warp reductions every tile, 18 us for a 7B layer's 512
    # keys on an H200); fp32 MHA, which would run "ieee" dots on the FMA units, multiplies and sums
    use_dot = group > 1 or q.dtype != torch.float32
    block_d = _block_d(D)
    block_n = block_n or _decode_block_n(block_d, use_dot, q.dtype, B * KVH, q.device)
    num_splits = num_splits or _decode_splits(B, KVH, max_len, block_n, q.device)
    if num_splits > 1:
        part_acc = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        part_m = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    _decode_kernel[(B, KVH, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l,
        scale * _LOG2E, stride_qb, stride_qh, out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), k_cache.shape[2],
        H=H, GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)) if use_dot else 1, D=D, BLOCK_D=block_d,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, USE_DOT=use_dot, UPCAST=_INTERPRET, PRECISION=_dot_precision(q.dtype),
        num_warps=4, num_stages=2, **rope_args, **pdl.launch_args(q),
    )
    if num_splits > 1:
        _decode_combine_kernel[(B, H)](
            part_acc, part_m, part_l, seq_lens, out, out.stride(0), out.stride(1),
            H=H, D=D, BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits), num_warps=4,
            **pdl.launch_args(q),
        )
    return out


# -- prefill ----------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_ptr, start_ptr,
    qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_cs, stride_bt, block_size,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query head, query block, sequence): flash-attention forward over the sequence's
    cached keys. Key tiles every row of the block sees run without masks; only the last few tiles
    (those overlapping the block's diagonal) apply the causal mask."""
    pdl.wait_prior(PDL)
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (last) query blocks start first
    s = tl.program_id(2)
    q_lo = tl.load(cu_seqlens_ptr + s).to(tl.int32)
    n = tl.load(cu_seqlens_ptr + s + 1).to(tl.int32) - q_lo
    if mb * BLOCK_M >= n:
        return
    start = tl.load(start_ptr + s).to(tl.int32)
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows within the sequence
    PADDED: tl.constexpr = BLOCK_D != D
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = (offs_d < D)[None, :]
    mask_m = (offs_m < n)[:, None]
    if PADDED:
        mask_m = mask_m & mask_d
    rows = (q_lo + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m, other=0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = start + offs_m  # query j sees keys 0..start + j

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh.to(tl.int64) * stride_ch
    v_base = v_cache_ptr + kvh.to(tl.int64) * stride_ch
    full_end = (start + mb * BLOCK_M + 1) // BLOCK_N * BLOCK_N  # keys every row of the block sees
    hi = start + tl.minimum((mb + 1) * BLOCK_M, n)
    for k_lo in range(0, full_end, BLOCK_N):
        offs_n = k_lo + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_base, v_base, bt_row, offs_n, None, offs_d, mask_d, block_size, stride_cb, stride_cs, False, PADDED, UPCAST)
        m_i, l_i, acc = _softmax_step(q, k, v, None, m_i, l_i, acc, qk_scale, True, PRECISION)
    for k_lo in range(full_end, hi, BLOCK_N):
        offs_n = k_lo + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        k, v = _load_kv(k_base, v_base, bt_row, offs_n, mask_n, offs_d, mask_d, block_size, stride_cb, stride_cs, True, PADDED, UPCAST)
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, True, PRECISION)

    out = acc / l_i[:, None]  # every real row sees at least its own key: l_i > 0
    o_ptrs = out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m)


def _prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head_dim (BLOCK_D) and dtype instead of
    autotuning; each compiles for sm_90 without register spills (half types: wgmma, fp32: "ieee" FMA dots)."""
    if _INTERPRET:  # small tiles so that small tests cross tile and diagonal boundaries
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return (32, 16, 4, 2) if head_dim <= 64 else (32, 16, 8, 2) if head_dim == 128 else (16, 16, 4, 2)
    if head_dim <= 64:
        return 128, 64, 4, 3
    return (128, 64, 8, 3) if head_dim == 128 else (64, 32, 8, 2)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, start_positions: torch.Tensor, scale: float, max_q_len: int,
) -> torch.Tensor:
    """Causal attention of packed variable-length queries q [T, H, D]: sequence s owns rows
    cu_seqlens_q[s]:cu_seqlens_q[s+1], has start_positions[s] tokens cached before them and its
    new K/V already in the cache; the mask is aligned bottom-right (query j of n sees start + j + 1
    keys). max_q_len (host int) sizes the grid; query blocks past a sequence's end exit at once."""
    _check_cache(k_cache, v_cache)
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    assert q.stride(-1) == 1 and H % KVH == 0 and k_cache.shape[3] == D and supports(D)
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if T == 0 or num_seqs == 0 or max_q_len == 0:
        return out
    block_d = _block_d(D)
    block_m, block_n, num_warps, num_stages = _prefill_config(block_d, q.dtype)
    _prefill_kernel[(H, cdiv(max_q_len, block_m), num_seqs)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, start_positions,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), k_cache.shape[2],
        GROUP=H // KVH, D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=_INTERPRET, PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_args(q),
    )
    return out


# -- op wrappers (the reference ops' signatures) ---------------------------------------------------


def rope_and_store_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
) -> torch.Tensor:
    if not supports(head_dim):
        return reference.rope_and_store_kv(qkv, cos, sin, k_cache, v_cache, meta, num_heads, num_kv_heads, head_dim)
    return rope_and_store(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, num_heads, num_kv_heads, head_dim)


def _prefill_plan(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cu_seqlens_q, start_positions, max_q_len) of a step, built with one host-to-device copy and
    kept on the metadata, which every layer of the step shares."""
    plan = getattr(meta, "_triton_prefill_plan", None)
    if plan is None:
        n = meta.num_seqs
        packed = torch.tensor(meta.token_offsets + meta.start_positions, dtype=torch.int32).to(device)
        lengths = [hi - lo for lo, hi in zip(meta.token_offsets, meta.token_offsets[1:])]
        plan = (packed[: n + 1], packed[n + 1 :], max(lengths, default=0))
        meta._triton_prefill_plan = plan
    return plan


def rope_store_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """rope_and_store_kv then attention; a decode-only step in one launch (the decode kernel
    rotates q and k itself and stores the new key and value: decode_attention's rope)."""
    if not (supports(head_dim) and meta.all_decode):
        q = rope_and_store_kv(qkv, cos, sin, k_cache, v_cache, meta, num_heads, num_kv_heads, head_dim)
        return attention(q, k_cache, v_cache, meta, scale)
    _check_cache(k_cache, v_cache)
    tables = meta.decode_block_tables
    return decode_attention(qkv, k_cache, v_cache, tables, meta.decode_lengths, scale, next_power_of_2(tables.shape[1] * k_cache.shape[2]),
                            rope=(cos, sin, meta.slot_mapping, num_heads))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """reference.attention on the paged cache. A decode-only step uses nothing from meta but its
    tensors (block_tables, decode_lengths) and the block tables' width, so it can be captured in a
    CUDA graph; any other step runs every sequence, single-token ones included, through one
    prefill launch."""
    if not supports(q.shape[-1]):
        return reference.attention(q, k_cache, v_cache, meta, scale)
    if meta.all_decode:  # the capacity rounded up: eager steps of growing tables compile a few split counts, not one per width
        tables = meta.decode_block_tables
        return decode_attention(q, k_cache, v_cache, tables, meta.decode_lengths, scale, next_power_of_2(tables.shape[1] * k_cache.shape[2]))
    cu_seqlens_q, start_positions, max_q_len = _prefill_plan(meta, q.device)
    return prefill_attention(q, k_cache, v_cache, meta.block_tables, cu_seqlens_q, start_positions, scale, max_q_len)
