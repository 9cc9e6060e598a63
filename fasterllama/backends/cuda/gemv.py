"""Decode GEMVs (one or two activation rows) over float, int8 and 4-bit weights, and the per-shape
choice between them and the general kernels, made by timing both on the device.

A batch-1 decode step reads every weight once: its speed is the rate at which the GEMVs stream
weights from memory. That takes many bytes in flight per multiprocessor, so each program here
reads a 16 KB weight tile per iteration (32 rows x 512 bytes), and it keeps its partial sums in
registers across the whole K loop ([rows, groups] for quantized weights: the scale of a group is
applied once per group, the sum over a group's values stays inside one thread), reducing them
across threads once at the end. Few row blocks (N = 4096: 128 of them) are split over K (split-K:
the last program of a row block to finish adds the parts up, in a fixed order, without a second
kernel). Which kernel is fastest for a shape depends
on the chip, so `tune()` times the candidates for each linear of a model once when the model is
prepared (milliseconds) and the ops dispatch on what it found; untuned shapes take the defaults.
Each GEMV loads its first weight tile before the programmatic-launch wait (pdl.py: weights, which
no kernel writes, stream in while the kernel before ends), then works tile by tile (a helper per
kernel does one tile's work, for the first tile and in the loop). A tile's helper issues all its
loads (activations, scales, mins) before any of its arithmetic: a load written after a layout
conversion's barrier starts only once the loads before it have arrived, one trip to memory after
another (the word-wise kernels took 4-8 such trips a tile until 2026-11-29; now one). A 4-bit and
int8 GEMV on the tensor cores (gemv_mma.py) is among tune()'s candidates for half-precision
activations, at one row against these GEMVs and at a decode batch (3..16 rows) against the tiled
kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import pdl, triton_linear
from .launch import cdiv, next_power_of_2
from .triton_norm import silu_mul

MAX_ROWS = 2  # activation rows the GEMVs take (more: the tiled kernels, which use tensor cores)
BATCH_MAX_ROWS = 16  # and the MMA GEMV (gemv_mma.py), where tune() timed it faster than the tiled kernel at BATCH_ROWS


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


@triton.jit
def arrived_last(counter, count):
    """After a program's stores of its part: whether it is the last of the `count` programs sharing
    `counter` to finish. A barrier puts every thread's stores before the count, the acq_rel atomic
    makes the others' parts visible to the last one, which combines them, then calls reset_counter."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == count - 1


@triton.jit
def reset_counter(counter):
    """The last program sets its counter back to 0: ready for the next launch."""
    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters that a split-K GEMV's programs of a row block count themselves done
    in; the last resets its own, so they stay zero between launches and one buffer a device serves
    every launch (a kernel waits for the one before to end). A larger one replaces it where
    needed, and the old one is kept: graphs captured with it still use it."""
    have = _COUNTERS.setdefault(device, [])
    if not have or have[-1].numel() < n:
        have.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return have[-1]


class Config(NamedTuple):
    block_n: int  # rows of W a program owns
    tile_bytes: int  # bytes of each row it reads per iteration (4-bit: half, each byte is two values)
    warps: int
    programs_per_sm: int  # split-K until the grid has this many programs per multiprocessor (0: no split, no reduce)
    prefetch: bool = False  # (the word-wise kernels) the next tile's loads go out before this tile's arithmetic
    round_in_loop: bool = False  # (the integer GEMVs, gemv_a8.py) round each tile's x in the K loop, not a slice before it
    round_first: bool = False  # (the integer GEMVs) x rounded once by a kernel of its own before the GEMV


# (no split: small matrices, whose GEMV is latency-bound, skip the split-K reduce's second launch;
# on an H200 a 576 x 576 GEMV took 2.3 us unsplit against 3.5 us split)
CONFIGS = (Config(32, 512, 8, 2), Config(16, 512, 4, 4), Config(64, 256, 8, 2), Config(8, 1024, 4, 8), Config(8, 1024, 4, 0), Config(16, 512, 4, 0))
DEFAULT_CONFIG = CONFIGS[0]
# The word-wise 4-bit GEMV: a thread owns block_n / warps rows of one group per tile (1,024 bytes a
# row: 32 groups of 32) and reuses each activation over them; 64 rows: 255 registers (two rows spill
# there, so those take 32).
# The prefetching configs hold two tiles in registers (sm_90: 168 and 96 registers without, 168 and
# 167 with, for 4-bit and int8 at 32 rows) and take ~7% more instructions (the copies from one
# tile's registers to the other's); they pay where a program waits for memory more than it computes.
WORD_CONFIGS = (Config(64, 1024, 4, 2), Config(32, 1024, 4, 2), Config(32, 1024, 4, 0), Config(32, 1024, 4, 3),
                Config(32, 1024, 4, 2, True), Config(32, 1024, 4, 0, True))
INT8_WORD_CONFIGS = (Config(64, 512, 4, 2), Config(32, 512, 4, 2), Config(32, 512, 4, 0), Config(32, 512, 4, 4),
                     Config(32, 512, 4, 2, True), Config(32, 512, 4, 0, True))


@triton.jit
def _to_f32_u4(q):
    """A nibble (int32 0..15) -> fp32 through its bit pattern (no int-to-float conversion)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _to_f32_s8(q):
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _act(ptr, offs, mask, K, GATED: tl.constexpr):
    """Activations at offs of a row (ptr), as fp32: x itself, or with GATED SiLU(gate) * up of a
    fused [gate | up] row of 2K (the down projection's input made where it is read, rounded as the
    SiLU·mul kernel rounds it: that kernel's launch goes)."""
    if GATED:
        g = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptr + K + offs, mask=mask, other=0.0).to(tl.float32)
        return silu_mul(g, up, ptr.dtype.element_ty).to(tl.float32)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _residual_sum(h_ptr, res_ptr, c, ok, HAS_RES: tl.constexpr):
    """h (+ res) at columns c, rounded to the model dtype as the residual stream is kept (fp32)."""
    h = tl.load(h_ptr + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        h = (h + tl.load(res_ptr + c, mask=ok, other=0.0).to(tl.float32)).to(h_ptr.dtype.element_ty).to(tl.float32)
    return h


@triton.jit
def _normed_rows(x_ptr, h_ptr, res_ptr, nw_ptr, res_out_ptr, M, K, eps, first, end, writer,
                 HAS_RES: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """NORM's prologue: x[:, first:end] (the columns this program's K loop reads) = RMSNorm(h + res),
    rounded as the RMSNorm kernel rounds it; the writer program also stores h + res, the new
    residual stream. A program takes the rows' sums of squares over the whole row itself (h and
    res from L2: a few KB, where the norm kernel it replaces was a launch); the programs sharing a
    K slice write the same bits to x, and the barrier orders this program's writes before its
    threads read them back. ONE_PASS (K <= BLOCK, the usual case): a row's loads, the norm
    weight's among them, go out together and the row stays in registers (one trip to L2 a row)."""
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    for m in range(M):
        if ONE_PASS:
            ok = cols < K
            w = tl.load(nw_ptr + cols, mask=ok & (cols >= first) & (cols < end), other=0.0).to(tl.float32)
            r = _residual_sum(h_ptr + m * K, res_ptr + m * K, cols, ok, HAS_RES)
            rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / K + eps)
            if HAS_RES:
                tl.store(res_out_ptr + m * K + cols, r.to(dtype), mask=ok & writer)
            tl.store(x_ptr + m * K + cols, (w * (r * rstd).to(dtype).to(tl.float32)).to(dtype), mask=ok & (cols >= first) & (cols < end))
        else:
            ss = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                c = k0 + cols
                r = _residual_sum(h_ptr + m * K, res_ptr + m * K, c, c < K, HAS_RES)
                ss += r * r
                if HAS_RES:
                    tl.store(res_out_ptr + m * K + c, r.to(dtype), mask=(c < K) & writer)
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
            for k0 in range(first, end, BLOCK):
                c = k0 + cols
                ok = c < end
                r = _residual_sum(h_ptr + m * K, res_ptr + m * K, c, ok, HAS_RES)
                w = tl.load(nw_ptr + c, mask=ok, other=0.0).to(tl.float32)
                tl.store(x_ptr + m * K + c, (w * (r * rstd).to(dtype).to(tl.float32)).to(dtype), mask=ok)
    tl.debug_barrier()


@triton.jit
def _store_out(out_ptr, bias_ptr, r0, r1, offs_n, n_ok, N, TWO: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Rows r0 (and r1) [rows] (+ bias) -> out, rounded once."""
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        r0 += b
        r1 += b
    tl.store(out_ptr + offs_n, r0.to(out_ptr.dtype.element_ty), mask=n_ok)
    if TWO:
        tl.store(out_ptr + N + offs_n, r1.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _store_rows(out_ptr, part_ptr, bias_ptr, done_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M,
                TWO: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Row sums of the accumulators (+ bias) -> out. Split over K (SPLITS_PAD > 1), each program
    stores its sums in part [splits, M, N] and counts itself done (an acq_rel atomic after a
    barrier, as decode attention's splits do); the last of a row block's programs adds the parts up
    in split order (the same sums whichever finishes last), writes out and sets the count back to
    0: no reduce kernel after the GEMV."""
    r0 = tl.sum(acc0, axis=1)
    r1 = r0
    if TWO:
        r1 = tl.sum(acc1, axis=1)
    if SPLITS_PAD == 1:
        _store_out(out_ptr, bias_ptr, r0, r1, offs_n, n_ok, N, TWO, HAS_BIAS)
    else:
        tl.store(part_ptr + pid_k * M * N + offs_n, r0, mask=n_ok)
        if TWO:
            tl.store(part_ptr + (pid_k * M + 1) * N + offs_n, r1, mask=n_ok)
        splits = tl.num_programs(1)
        counter = done_ptr + pid_n
        if arrived_last(counter, splits):
            sp = tl.arange(0, SPLITS_PAD)
            ok = (sp < splits)[:, None] & n_ok[None, :]
            parts = part_ptr + (sp * M * N)[:, None] + offs_n[None, :]
            t0 = tl.sum(tl.load(parts, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)  # (.cg: past L1, other programs wrote them)
            t1 = t0
            if TWO:
                t1 = tl.sum(tl.load(parts + N, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
            _store_out(out_ptr, bias_ptr, t0, t1, offs_n, n_ok, N, TWO, HAS_BIAS)
            reset_counter(counter)


@triton.jit
def _int8_group_params(s_ptr, mn_ptr, offs_n, n_ok, g, g_ok, G, PER_GROUP: tl.constexpr, HAS_MINS: tl.constexpr):
    """A tile's group scales (and mins) [rows, groups], loaded before the tile's arithmetic so that
    their trips to memory overlap it. Per channel: placeholders (the scale comes at the end)."""
    s = tl.zeros([1, 1], dtype=tl.float32)
    mn = s
    if PER_GROUP:
        gs_off = offs_n[:, None] * G + g[None, :]
        gs_ok = n_ok[:, None] & g_ok[None, :]
        s = tl.load(s_ptr + gs_off, mask=gs_ok, other=0.0).to(tl.float32)
        if HAS_MINS:
            mn = tl.load(mn_ptr + gs_off, mask=gs_ok, other=0.0).to(tl.float32)
    return s, mn


@triton.jit
def _int8_add_groups(acc0, acc1, r0, r1, s, mn, xs0, xs1, PER_GROUP: tl.constexpr, TWO: tl.constexpr, HAS_MINS: tl.constexpr):
    """acc += the groups' sums r [rows, groups] times their scales (+ min * sum(x) per group), or
    r as they are (per channel: the scale comes at the end)."""
    if PER_GROUP:
        acc0 += r0 * s
        if TWO:
            acc1 += r1 * s
        if HAS_MINS:
            acc0 += mn * xs0
            if TWO:
                acc1 += mn * xs1
    else:
        acc0 += r0
        if TWO:
            acc1 += r1
    return acc0, acc1


@triton.jit
def _int8_store(out_ptr, part_ptr, bias_ptr, done_ptr, s_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, PER_GROUP: tl.constexpr,
                TWO: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The row sums (per channel: times the channel's scale) -> out (_store_rows)."""
    if not PER_GROUP:
        s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        acc0 *= s
        acc1 *= s
    _store_rows(out_ptr, part_ptr, bias_ptr, done_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, TWO, SPLITS_PAD, HAS_BIAS)


@triton.jit
def _float_tile(w, k, acc0, acc1, x_ptr, stride_xm, K, TWO: tl.constexpr, GATED: tl.constexpr):
    """One tile of _float_gemv_kernel: weights w [rows, BLOCK_K] at columns k."""
    k_ok = k < K
    w = w.to(tl.float32)
    acc0 += w * _act(x_ptr, k, k_ok, K, GATED)[None, :]
    if TWO:
        acc1 += w * _act(x_ptr + stride_xm, k, k_ok, K, GATED)[None, :]
    return acc0, acc1


@triton.jit
def _float_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, K_SPLIT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
                       PDL: tl.constexpr, GATED: tl.constexpr = False,
                       h_ptr=None, res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                       HAS_RES: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1, NORM_ONE_PASS: tl.constexpr = True, part_ptr=None,
                       bias_ptr=None, done_ptr=None, SPLITS_PAD: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    first, end = pid_k * K_SPLIT, tl.minimum(pid_k * K_SPLIT + K_SPLIT, K)
    k = first + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    pdl.wait_prior(PDL)
    if NORM:  # (x_ptr: the normed rows, made here)
        _normed_rows(x_ptr, h_ptr, res_ptr, nw_ptr, res_out_ptr, M, K, eps, first, end, (pid_n == 0) & (pid_k == 0), HAS_RES, NORM_BLOCK,
                     NORM_ONE_PASS)
    acc0, acc1 = _float_tile(w, k, acc0, acc1, x_ptr, stride_xm, K, TWO, GATED)
    for k0 in range(first + BLOCK_K, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        acc0, acc1 = _float_tile(w, k, acc0, acc1, x_ptr, stride_xm, K, TWO, GATED)
    _store_rows(out_ptr, part_ptr, bias_ptr, done_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, TWO, SPLITS_PAD, HAS_BIAS)


@triton.jit
def _int8_tile(q, g, acc0, acc1, x_ptr, s_ptr, mn_ptr, stride_xm, offs_n, n_ok, K, G,
               GS: tl.constexpr, PER_GROUP: tl.constexpr, TWO: tl.constexpr, HAS_MINS: tl.constexpr, GATED: tl.constexpr):
    """One tile of _int8_gemv_kernel: int8 weights q [rows, GPB, GS] of groups g."""
    g_ok = g < K // GS
    k = g[:, None] * GS + tl.arange(0, GS)[None, :]
    sc, mn = _int8_group_params(s_ptr, mn_ptr, offs_n, n_ok, g, g_ok, G, PER_GROUP, HAS_MINS)
    x0 = _act(x_ptr, k, g_ok[:, None], K, GATED)
    x1 = x0
    if TWO:
        x1 = _act(x_ptr + stride_xm, k, g_ok[:, None], K, GATED)
    w = _to_f32_s8(q)
    r0 = tl.sum(w * x0[None, :, :], axis=2)
    r1 = r0
    if TWO:
        r1 = tl.sum(w * x1[None, :, :], axis=2)
    return _int8_add_groups(acc0, acc1, r0, r1, sc, mn, tl.sum(x0, axis=1)[None, :], tl.sum(x1, axis=1)[None, :], PER_GROUP, TWO, HAS_MINS)


@triton.jit
def _int8_gemv_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, out_ptr, M, N, K, stride_xm, K_SPLIT, G,
                      GS: tl.constexpr, GPB: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr,
                      HAS_MINS: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr = False,
                      h_ptr=None, res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                      HAS_RES: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1, NORM_ONE_PASS: tl.constexpr = True, part_ptr=None,
                      bias_ptr=None, done_ptr=None, SPLITS_PAD: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False):
    """Tiles [BLOCK_N, GPB, GS]: GPB groups of GS columns (per channel: GS-column chunks, the
    scale applied at the end). K % GS == 0. With mins (per group), min * sum(x) per group."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None, None] * K
    offs_j = tl.arange(0, GS)[None, None, :]
    acc0 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    first, end = pid_k * K_SPLIT, tl.minimum(pid_k * K_SPLIT + K_SPLIT, K)
    g = first // GS + tl.arange(0, GPB)
    q = tl.load(w_rows + g[None, :, None] * GS + offs_j, mask=n_ok[:, None, None] & (g < K // GS)[None, :, None], other=0)
    pdl.wait_prior(PDL)
    if NORM:  # (x_ptr: the normed rows, made here)
        _normed_rows(x_ptr, h_ptr, res_ptr, nw_ptr, res_out_ptr, M, K, eps, first, end, (pid_n == 0) & (pid_k == 0), HAS_RES, NORM_BLOCK,
                     NORM_ONE_PASS)
    acc0, acc1 = _int8_tile(q, g, acc0, acc1, x_ptr, s_ptr, mn_ptr, stride_xm, offs_n, n_ok, K, G, GS, PER_GROUP, TWO, HAS_MINS, GATED)
    for k0 in range(first + GPB * GS, end, GPB * GS):
        g = k0 // GS + tl.arange(0, GPB)
        q = tl.load(w_rows + g[None, :, None] * GS + offs_j, mask=n_ok[:, None, None] & (g < K // GS)[None, :, None], other=0)
        acc0, acc1 = _int8_tile(q, g, acc0, acc1, x_ptr, s_ptr, mn_ptr, stride_xm, offs_n, n_ok, K, G, GS, PER_GROUP, TWO, HAS_MINS, GATED)
    _int8_store(out_ptr, part_ptr, bias_ptr, done_ptr, s_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, PER_GROUP, TWO, SPLITS_PAD,
                HAS_BIAS)


@triton.jit
def _int4_tile(p, g, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, K, G, GS: tl.constexpr, TWO: tl.constexpr,
               GATED: tl.constexpr, HAS_MINS: tl.constexpr, GPS: tl.constexpr):
    """One tile of _int4_gemv_kernel: packed bytes p [rows, GPB, GS/2] of groups g."""
    HALF: tl.constexpr = GS // 2
    g_ok = g < G
    p = p.to(tl.int32)
    lo, hi = _to_f32_u4(p & 15), _to_f32_u4(p >> 4)
    s, mn = triton_linear.q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, g, n_ok[:, None] & g_ok[None, :], G, HAS_MINS, GPS)
    k = g[:, None] * GS + tl.arange(0, HALF)[None, :]
    xl = _act(x_ptr, k, g_ok[:, None], K, GATED)
    xh = _act(x_ptr, k + HALF, g_ok[:, None], K, GATED)
    acc0 += tl.sum(lo * xl[None, :, :] + hi * xh[None, :, :], axis=2) * s + mn * tl.sum(xl + xh, axis=1)[None, :]
    if TWO:
        xl = _act(x_ptr + stride_xm, k, g_ok[:, None], K, GATED)
        xh = _act(x_ptr + stride_xm, k + HALF, g_ok[:, None], K, GATED)
        acc1 += tl.sum(lo * xl[None, :, :] + hi * xh[None, :, :], axis=2) * s + mn * tl.sum(xl + xh, axis=1)[None, :]
    return acc0, acc1


@triton.jit
def _int4_gemv_kernel(x_ptr, p_ptr, s_ptr, mn_ptr, out_ptr, M, N, K, stride_xm, KB_SPLIT,
                      GS: tl.constexpr, GPB: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr,
                      GATED: tl.constexpr = False,
                      h_ptr=None, res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                      HAS_RES: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1, NORM_ONE_PASS: tl.constexpr = True, part_ptr=None,
                      bias_ptr=None, done_ptr=None, SPLITS_PAD: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False,
                      HAS_MINS: tl.constexpr = True, ss_ptr=None, ms_ptr=None, GPS: tl.constexpr = 0):
    """Tiles [BLOCK_N, GPB, GS/2] bytes (pack_int4: byte j of a group holds values j and j + GS/2);
    per group, sum w x = scale * sum q x + min * sum x (scales and mins: triton_linear.q4_params)."""
    HALF: tl.constexpr = GS // 2
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    KB = K // 2
    G = K // GS
    p_rows = p_ptr + offs_n.to(tl.int64)[:, None, None] * KB
    offs_j = tl.arange(0, HALF)[None, None, :]
    acc0 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    first, end = pid_k * KB_SPLIT, tl.minimum(pid_k * KB_SPLIT + KB_SPLIT, KB)
    g = first // HALF + tl.arange(0, GPB)
    p = tl.load(p_rows + g[None, :, None] * HALF + offs_j, mask=n_ok[:, None, None] & (g < G)[None, :, None], other=0)
    pdl.wait_prior(PDL)
    if NORM:  # (x_ptr: the normed rows, made here)
        _normed_rows(x_ptr, h_ptr, res_ptr, nw_ptr, res_out_ptr, M, K, eps, 2 * first, 2 * end, (pid_n == 0) & (pid_k == 0), HAS_RES, NORM_BLOCK,
                     NORM_ONE_PASS)
    acc0, acc1 = _int4_tile(p, g, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, K, G, GS, TWO, GATED, HAS_MINS, GPS)
    for b0 in range(first + GPB * HALF, end, GPB * HALF):
        g = b0 // HALF + tl.arange(0, GPB)
        p = tl.load(p_rows + g[None, :, None] * HALF + offs_j, mask=n_ok[:, None, None] & (g < G)[None, :, None], other=0)
        acc0, acc1 = _int4_tile(p, g, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, K, G, GS, TWO, GATED, HAS_MINS, GPS)
    _store_rows(out_ptr, part_ptr, bias_ptr, done_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, TWO, SPLITS_PAD, HAS_BIAS)


@triton.jit
def _words_tile(words, f, n_ok, KW, wanted=True):
    """The words [rows, WB] at word indices f [WB] of the rows (KW words long), if wanted (a scalar:
    a prefetch past the program's share of K loads nothing)."""
    return tl.load(words + f[None, :], mask=n_ok[:, None] & (f < KW)[None, :] & wanted, other=0)


@triton.jit
def _column(x, j: tl.constexpr, C: tl.constexpr):
    """Column j of x [n, C] (C = 4 or 8), by halving splits: the loads of a word's activations
    come as one 2-D tile, its columns meet the weights' bit fields one at a time."""
    if C == 8:
        odd0, odd1 = tl.split(tl.reshape(x, [x.shape[0], 2, 2, 2]))  # j % 2 == 0 / 1
        y = odd0 if j % 2 == 0 else odd1
        mid0, mid1 = tl.split(y)  # (j // 2) % 2
        z = mid0 if (j // 2) % 2 == 0 else mid1
        c0, c1 = tl.split(z)
        return c0 if j // 4 == 0 else c1
    else:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], 2, 2]))  # columns 0, 2 and 1, 3
        y = even if j % 2 == 0 else odd
        c0, c2 = tl.split(y)
        return c0 if j < 2 else c2


@triton.jit
def _int4_words_group_sums(s, sc, mn, x, BLOCK_N: tl.constexpr, GPB: tl.constexpr, WPG: tl.constexpr, RAW_HI: tl.constexpr):
    """A tile's [rows, groups] sums of w x from the words' sums s = sum (1 + q/16) x: 16 scale * S +
    (min - 16 scale) * sum x (sc = 16 scale, mn = min - 16 scale; x the words' activations
    [words, 8]); with RAW_HI, less the 0x3F80 the high halves carried (times the sum of x over
    the values they hold: columns 2, 3, 6, 7 of a word's 8)."""
    S = tl.sum(tl.reshape(s, [BLOCK_N, GPB, WPG]), axis=2)
    xg = tl.reshape(x, [GPB, WPG * 8])
    if RAW_HI:
        S -= (16256.0 / 8388608.0) * tl.sum(tl.where(((tl.arange(0, WPG * 8) & 2) != 0)[None, :], xg, 0.0), axis=1)[None, :]
    return S * sc + mn * tl.sum(xg, axis=1)[None, :]


@triton.jit
def _int4_words_tile(w, f, b0, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, KW, G, ONES,
                     GS: tl.constexpr, GPB: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr, RAW_HI: tl.constexpr,
                     GATED: tl.constexpr, HAS_MINS: tl.constexpr, GPS: tl.constexpr):
    """One tile of _int4_words_gemv_kernel: words w [rows, GPB groups' words] at word indices f
    from byte b0 of the rows, added to the [rows, groups] sums. Every load comes first, so that
    the tile's trips to memory overlap: the 8 activations of each word in one [words, 2, 4] load
    (values kb..kb+3 and kb + GS/2..; one trip a tile instead of eight), the groups' x, scales
    and mins."""
    H: tl.constexpr = GS // 2
    WPG: tl.constexpr = GS // 8
    WB: tl.constexpr = GPB * WPG
    f_ok = f < KW
    g = b0 // H + tl.arange(0, GPB)
    g_ok = g < G
    kb = (f // WPG) * GS + 4 * (f % WPG)  # the first (low-nibble) value of each word
    run = kb[:, None, None] + (tl.arange(0, 2) * H)[None, :, None] + tl.arange(0, 4)[None, None, :]
    if GPS > 0:  # a K-quant's factored scales (triton_linear.q4_params): each super-block's word loaded once a tile, broadcast
        NS: tl.constexpr = GPB // GPS
        sm = tl.load(s_ptr.to(tl.pointer_type(tl.int16)) + offs_n[:, None] * G + g[None, :], mask=n_ok[:, None] & g_ok[None, :], other=0)
        sg = b0 // H // GPS + tl.arange(0, NS)
        sup = tl.load(ss_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None] * (G // GPS) + sg[None, :],
                      mask=n_ok[:, None] & (sg < G // GPS)[None, :], other=0)
    else:
        s, mn = triton_linear.q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, g, n_ok[:, None] & g_ok[None, :], G, HAS_MINS, GPS)
    x0 = _act(x_ptr, run, f_ok[:, None, None], KW * 8, GATED)
    x1 = x0
    if TWO:
        x1 = _act(x_ptr + stride_xm, run, f_ok[:, None, None], KW * 8, GATED)
    if GPS > 0:  # (the arithmetic after x's loads: every load of the tile is on its way first)
        sup = tl.reshape(tl.broadcast_to(sup[:, :, None], [BLOCK_N, NS, GPS]), [BLOCK_N, GPB])
        s, mn = triton_linear._q4_factors(sm.to(tl.int32), sup)
    sc = s * 16.0
    mn -= sc
    x0, x1 = tl.reshape(x0, [WB, 8]), tl.reshape(x1, [WB, 8])
    s0 = tl.zeros([BLOCK_N, WB], dtype=tl.float32)
    s1 = tl.zeros([BLOCK_N, WB], dtype=tl.float32)
    for s in tl.static_range(4):
        if s == 0:
            v = ((w << 3) & 0x00780078) | ONES
        else:
            v = ((w >> (4 * s - 3)) & 0x00780078) | ONES
        lo = (v << 16).to(tl.float32, bitcast=True)
        if RAW_HI:  # the low half's bits add (16256 + 8 q_lo) 2^-23: the part without q_lo taken back per group
            hi = v.to(tl.float32, bitcast=True)
        else:
            hi = (v & -65536).to(tl.float32, bitcast=True)
        c = (s // 2) + (s % 2) * 4  # bits 4s.. hold value c of the [2, 4] runs (run c // 4, element c % 4); bits 16 + 4s.. value c + 2
        s0 = tl.fma(hi, _column(x0, c + 2, 8)[None, :], tl.fma(lo, _column(x0, c, 8)[None, :], s0))
        if TWO:
            s1 = tl.fma(hi, _column(x1, c + 2, 8)[None, :], tl.fma(lo, _column(x1, c, 8)[None, :], s1))
    acc0 += _int4_words_group_sums(s0, sc, mn, x0, BLOCK_N, GPB, WPG, RAW_HI)
    if TWO:
        acc1 += _int4_words_group_sums(s1, sc, mn, x1, BLOCK_N, GPB, WPG, RAW_HI)
    return acc0, acc1


@triton.jit
def _int4_words_gemv_kernel(x_ptr, p_ptr, s_ptr, mn_ptr, out_ptr, M, N, K, stride_xm, KB_SPLIT, ONES,
                             GS: tl.constexpr, GPB: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr,
                             PREFETCH: tl.constexpr = False, GATED: tl.constexpr = False,
                             h_ptr=None, res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                             HAS_RES: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1, NORM_ONE_PASS: tl.constexpr = True, part_ptr=None,
                             bias_ptr=None, done_ptr=None, SPLITS_PAD: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False,
                             HAS_MINS: tl.constexpr = True, ss_ptr=None, ms_ptr=None, GPS: tl.constexpr = 0):
    """4-bit GEMV over the packing's 32-bit words. ((w >> (4s - 3)) & 0x00780078) | 0x3F803F80
    holds two nibbles as the bf16 numbers 1 + q/16, each an fp32 one shift or mask away: ~2 integer
    ops and one FMA a weight, into an accumulator per word (with half-precision activations 1.5:
    the high half is read with the low half's bits below it, RAW_HI; sm_90 SASS 3.46 instructions a
    weight at 64 rows, 3.74 at 32: benchmarks/gpu_sass.py). Per group, sum w x = 16 scale * S +
    (min - 16 scale) * X, with S = sum (1 + q/16) x and X = sum x. Word i of a group holds values
    4i..4i+3 (low nibbles) and GS/2 + 4i.. (high), as pack_int4 lays them out. ONES = 0x3F803F80
    comes as an argument: in a register, the mask-and-or is one LOP3 (two immediates take two)."""
    H: tl.constexpr = GS // 2
    RAW_HI: tl.constexpr = x_ptr.dtype.element_ty != tl.float32  # (its error is far below bf16's and fp16's rounding, not fp32's)
    WB: tl.constexpr = GPB * (GS // 8)  # words of a row a tile
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    KW = tl.multiple_of(K // 8, GS // 8)  # K % GS == 0: 16-byte aligned rows of whole groups
    rows = offs_n.to(tl.int64) * KW
    offs_f = tl.arange(0, WB)
    acc0 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    words = p_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None]
    first, end = pid_k * KB_SPLIT, tl.minimum(pid_k * KB_SPLIT + KB_SPLIT, K // 2)
    w = _words_tile(words, first // 4 + offs_f, n_ok, KW)  # (weights: no kernel writes them)
    pdl.wait_prior(PDL)  # the first tile was on its way while the kernel before ended
    if NORM:  # (x_ptr: the normed rows, made here)
        _normed_rows(x_ptr, h_ptr, res_ptr, nw_ptr, res_out_ptr, M, K, eps, 2 * first, 2 * end, (pid_n == 0) & (pid_k == 0), HAS_RES, NORM_BLOCK,
                     NORM_ONE_PASS)
    if PREFETCH:  # the next tile's loads in flight during this tile's arithmetic (two tiles of registers)
        for b0 in range(first, end, GPB * H):
            f = b0 // 4 + offs_f  # word index along the row
            w_next = _words_tile(words, f + WB, n_ok, KW, b0 + GPB * H < end)
            acc0, acc1 = _int4_words_tile(w, f, b0, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, KW, K // GS, ONES,
                                          GS, GPB, BLOCK_N, TWO, RAW_HI, GATED, HAS_MINS, GPS)
            w = w_next
    else:
        acc0, acc1 = _int4_words_tile(w, first // 4 + offs_f, first, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm, offs_n, n_ok, KW,
                                      K // GS, ONES, GS, GPB, BLOCK_N, TWO, RAW_HI, GATED, HAS_MINS, GPS)
        for b0 in range(first + GPB * H, end, GPB * H):
            f = b0 // 4 + offs_f
            acc0, acc1 = _int4_words_tile(_words_tile(words, f, n_ok, KW), f, b0, acc0, acc1, x_ptr, s_ptr, mn_ptr, ss_ptr, ms_ptr, stride_xm,
                                          offs_n, n_ok, KW, K // GS, ONES, GS, GPB, BLOCK_N, TWO, RAW_HI, GATED, HAS_MINS, GPS)
    _store_rows(out_ptr, part_ptr, bias_ptr, done_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, TWO, SPLITS_PAD, HAS_BIAS)


@triton.jit
def _int8_words_tile(w, f, k0, acc0, acc1, x_ptr, s_ptr, mn_ptr, stride_xm, offs_n, n_ok, KW, G, LOW, HIGH,
                     GS: tl.constexpr, GPB: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr,
                     HAS_MINS: tl.constexpr, GATED: tl.constexpr):
    """One tile of _int8_words_gemv_kernel: words w [rows, GPB groups' words] at word indices f
    from column k0, added to the [rows, groups] sums. The 4 activations of each word come in one
    load ([WB, 4]: one trip to memory a tile instead of 4), before the scales'."""
    WPG: tl.constexpr = GS // 4
    WB: tl.constexpr = GPB * WPG
    f_ok = f < KW
    g = k0 // GS + tl.arange(0, GPB)
    sc, mn = _int8_group_params(s_ptr, mn_ptr, offs_n, n_ok, g, g < G, G, PER_GROUP, HAS_MINS)
    j = tl.arange(0, 4)
    x0 = _act(x_ptr, 4 * f[:, None] + j[None, :], f_ok[:, None], KW * 4, GATED)
    x1 = x0
    if TWO:
        x1 = _act(x_ptr + stride_xm, 4 * f[:, None] + j[None, :], f_ok[:, None], KW * 4, GATED)
    xs0 = tl.sum(tl.reshape(x0, [GPB, GS]), axis=1)[None, :]  # (with mins: min * sum x per group)
    xs1 = tl.sum(tl.reshape(x1, [GPB, GS]), axis=1)[None, :]
    unit = tl.where(j % 2 == 1, 1.0 / 65536.0, 1.0)[None, :]  # the odd bytes are read as 2^16 q
    x0, x1 = x0 * unit, x1 * unit
    s0 = tl.zeros([BLOCK_N, WB], dtype=tl.float32)
    s1 = tl.zeros([BLOCK_N, WB], dtype=tl.float32)
    for b in tl.static_range(4):
        half = w if b < 2 else w >> 16
        if b % 2 == 0:
            q = ((half & 0xFF) ^ LOW).to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128
        else:
            q = ((half & 0xFF00) ^ HIGH).to(tl.float32, bitcast=True) - 2155872256.0  # 2^31 + 2^23: 2^16 q
        s0 = tl.fma(q, _column(x0, b, 4)[None, :], s0)
        if TWO:
            s1 = tl.fma(q, _column(x1, b, 4)[None, :], s1)
    r0 = tl.sum(tl.reshape(s0, [BLOCK_N, GPB, WPG]), axis=2)
    r1 = r0
    if TWO:
        r1 = tl.sum(tl.reshape(s1, [BLOCK_N, GPB, WPG]), axis=2)
    return _int8_add_groups(acc0, acc1, r0, r1, sc, mn, xs0, xs1, PER_GROUP, TWO, HAS_MINS)


@triton.jit
def _int8_words_gemv_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, out_ptr, M, N, K, stride_xm, K_SPLIT, G, LOW, HIGH,
                            GS: tl.constexpr, GPB: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, TWO: tl.constexpr,
                            HAS_MINS: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False, GATED: tl.constexpr = False,
                            h_ptr=None, res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                            HAS_RES: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1, NORM_ONE_PASS: tl.constexpr = True, part_ptr=None,
                            bias_ptr=None, done_ptr=None, SPLITS_PAD: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False):
    """int8 GEMV over 32-bit words, one integer op a byte: (w & 0xFF) ^ LOW (LOW = 0x4B000080) puts
    the low byte with its sign bit flipped under the exponent of 2^23, the fp32 2^23 + 128 + q;
    (w & 0xFF00) ^ HIGH (HIGH = 0x4F008000) the next byte under 2^31's, 2^31 + 2^16 (128 + q);
    the upper two bytes the same after one shift. One FADD takes the offset off (q or 2^16 q,
    the latter met by x 2^-16), and each activation (a word's 4 in one load) serves every row a
    thread owns. LOW and HIGH come as arguments: in registers, mask-and-xor is one LOP3. Accumulators
    per word; per group (PER_GROUP) their sums are scaled, else the channel's scale comes at the end."""
    WB: tl.constexpr = GPB * (GS // 4)  # (GS // 4 words a group; per channel: a chunk of GS columns)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    KW = tl.multiple_of(K // 4, GS // 4)  # K % GS == 0
    rows = offs_n.to(tl.int64) * KW
    offs_f = tl.arange(0, WB)
    acc0 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    words = w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None]
    first, end = pid_k * K_SPLIT, tl.minimum(pid_k * K_SPLIT + K_SPLIT, K)
    w = _words_tile(words, first // 4 + offs_f, n_ok, KW)  # (weights: no kernel writes them)
    pdl.wait_prior(PDL)  # the first tile was on its way while the kernel before ended
    if NORM:  # (x_ptr: the normed rows, made here)
        _normed_rows(x_ptr, h_ptr, res_ptr, nw_ptr, res_out_ptr, M, K, eps, first, end, (pid_n == 0) & (pid_k == 0), HAS_RES, NORM_BLOCK,
                     NORM_ONE_PASS)
    if PREFETCH:  # the next tile's loads in flight during this tile's arithmetic (two tiles of registers)
        for k0 in range(first, end, GPB * GS):
            f = k0 // 4 + offs_f
            w_next = _words_tile(words, f + WB, n_ok, KW, k0 + GPB * GS < end)
            acc0, acc1 = _int8_words_tile(w, f, k0, acc0, acc1, x_ptr, s_ptr, mn_ptr, stride_xm, offs_n, n_ok, KW, G, LOW, HIGH,
                                          GS, GPB, PER_GROUP, BLOCK_N, TWO, HAS_MINS, GATED)
            w = w_next
    else:
        acc0, acc1 = _int8_words_tile(w, first // 4 + offs_f, first, acc0, acc1, x_ptr, s_ptr, mn_ptr, stride_xm, offs_n, n_ok, KW, G,
                                      LOW, HIGH, GS, GPB, PER_GROUP, BLOCK_N, TWO, HAS_MINS, GATED)
        for k0 in range(first + GPB * GS, end, GPB * GS):
            f = k0 // 4 + offs_f
            acc0, acc1 = _int8_words_tile(_words_tile(words, f, n_ok, KW), f, k0, acc0, acc1, x_ptr, s_ptr, mn_ptr, stride_xm,
                                          offs_n, n_ok, KW, G, LOW, HIGH, GS, GPB, PER_GROUP, BLOCK_N, TWO, HAS_MINS, GATED)
    _int8_store(out_ptr, part_ptr, bias_ptr, done_ptr, s_ptr, acc0, acc1, offs_n, n_ok, N, pid_n, pid_k, M, PER_GROUP, TWO, SPLITS_PAD,
                HAS_BIAS)


NORM_BLOCK = 4096  # columns a normed GEMV's prologue loads at a time (the model's hidden size fits: one trip to L2)


class Norm(NamedTuple):
    """A normed GEMV's input: x is h, and the GEMV multiplies RMSNorm(h + residual) (the norm
    kernel before it goes), storing h + residual, the new residual stream, in residual_out."""
    residual: torch.Tensor | None  # None: RMSNorm(h), residual_out is h
    weight: torch.Tensor
    eps: float
    residual_out: torch.Tensor


def _norm_args(h2: torch.Tensor, norm: Norm | None) -> tuple[torch.Tensor, dict]:
    """(the rows the K loop reads, the kernel's NORM arguments): with a norm, a buffer its programs
    fill with the normed rows."""
    if norm is None:
        return h2, {}
    K = h2.shape[1]
    res = norm.residual.reshape(h2.shape).contiguous() if norm.residual is not None else h2
    return torch.empty_like(h2), dict(h_ptr=h2, res_ptr=res, nw_ptr=norm.weight, res_out_ptr=norm.residual_out, eps=norm.eps, NORM=True,
                                      HAS_RES=norm.residual is not None, NORM_BLOCK=min(next_power_of_2(K), NORM_BLOCK),
                                      NORM_ONE_PASS=K <= NORM_BLOCK)


def _launch(kernel, cfg: Config, x2: torch.Tensor, N: int, K: int, span: int, step: int, bias, out_dtype, args: tuple,
            norm: Norm | None = None, pad_rows: bool = False, **meta) -> torch.Tensor:
    """Grid over row blocks and slices of the `span` a program walks in `step`s (K, or K/2 bytes of
    4-bit weights): split-K when the row blocks alone do not fill the chip. The kernel takes one or
    two rows (TWO), or with pad_rows any number up to M_PAD, a power of two."""
    M = x2.shape[0]
    if M == 0:  # (the kernels store their rows unconditionally)
        return torch.empty(0, N, dtype=out_dtype, device=x2.device)
    x2, norm_args = _norm_args(x2, norm)
    blocks = cdiv(N, cfg.block_n)
    steps = cdiv(span, step)
    per = cdiv(steps, max(1, min(steps, cdiv(cfg.programs_per_sm * triton_linear._num_sms(x2.device), blocks))))
    splits = cdiv(steps, per)
    out = torch.empty(M, N, dtype=out_dtype, device=x2.device)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x2.device) if splits > 1 else out
    done = split_counters(x2.device, blocks) if splits > 1 else out
    rows = {"M_PAD": next_power_of_2(M)} if pad_rows else {"TWO": M == 2}
    kernel[(blocks, splits)](x2, *args, out, M, N, K, x2.stride(0), per * step, BLOCK_N=cfg.block_n, **rows, num_warps=cfg.warps,
                             part_ptr=part, bias_ptr=out if bias is None else bias, done_ptr=done, SPLITS_PAD=next_power_of_2(splits),
                             HAS_BIAS=bias is not None, **meta, **norm_args, **pdl.launch_args(x2))
    return out


def _rows(x: torch.Tensor, K: int, gated: bool, norm: Norm | None = None) -> torch.Tensor:
    assert x.shape[-1] == (2 * K if gated else K) and not (gated and norm), (tuple(x.shape), K, gated)
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 and (norm is None or x2.is_contiguous()) else x2.contiguous()


def float_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cfg: Config = DEFAULT_CONFIG,
               gated: bool = False, norm: Norm | None = None) -> torch.Tensor:
    """gated (here and below): x is a fused [gate | up] projection's output [.., 2K], and the
    GEMV multiplies SiLU(gate) * up, made as it reads them. norm: the GEMV multiplies the RMSNorm
    of x (+ a residual), made by its own programs (Norm)."""
    N, K = weight.shape
    x2 = _rows(x, K, gated, norm)
    block_k = cfg.tile_bytes // weight.element_size()
    out = _launch(_float_gemv_kernel, cfg, x2, N, K, K, block_k, bias, x.dtype, (weight.contiguous(),), norm, BLOCK_K=block_k, GATED=gated)
    return out.view(*x.shape[:-1], N)


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              cfg: Config = DEFAULT_CONFIG, mins: torch.Tensor | None = None, words: bool = False, gated: bool = False,
              norm: Norm | None = None) -> torch.Tensor:
    """words: the kernel reading 32-bit words (a byte to fp32 in two ops), else byte-wise."""
    N, K = qweight.shape
    s = scale.reshape(N, -1)
    G = s.shape[1]
    gs = K // G if G > 1 else 32
    x2 = _rows(x, K, gated, norm)
    gpb = max(1, cfg.tile_bytes // gs)
    qweight = qweight.contiguous()
    args = (qweight, s.contiguous(), s if mins is None else mins.contiguous())
    kernel, extra = _int8_gemv_kernel, {}
    if words and gs >= 4 and qweight.data_ptr() % 4 == 0:  # (read as int32)
        kernel, extra = _int8_words_gemv_kernel, {"LOW": 0x4B000080, "HIGH": 0x4F008000, "PREFETCH": cfg.prefetch}
    out = _launch(kernel, cfg, x2, N, K, K, gpb * gs, bias, x.dtype, args, norm, G=G, GS=gs, GPB=gpb, PER_GROUP=G > 1,
                  HAS_MINS=mins is not None, GATED=gated, **extra)
    return out.view(*x.shape[:-1], N)


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
              bias: torch.Tensor | None = None, cfg: Config = DEFAULT_CONFIG, words: bool = False, gated: bool = False,
              norm: Norm | None = None, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """words: the kernel reading 32-bit words (two nibbles an integer op), else byte-wise. mins
    None: Q4_0's symmetric groups (min = -8 * scale, not read); sups: a K-quant's factored scales
    and mins (triton_linear.q4_args)."""
    N = packed.shape[0]
    K = packed.shape[1] * 2
    x2 = _rows(x, K, gated, norm)
    gpb = max(1, cfg.tile_bytes // 2 // (group_size // 2))  # half the bytes: each unpacks to two values in registers
    (s, mn), extra = triton_linear.q4_args(scales, mins, sups)
    assert gpb % max(extra["GPS"], 1) == 0, "a tile of whole super-blocks"  # (the word-wise kernel loads a tile's super-block values once)
    args = (packed.contiguous(), s, mn)
    kernel = _int4_gemv_kernel
    if words and packed.data_ptr() % 4 == 0:  # (read as int32)
        kernel, extra = _int4_words_gemv_kernel, {**extra, "ONES": 0x3F803F80, "PREFETCH": cfg.prefetch}
        cfg = cfg._replace(block_n=min(cfg.block_n, 32)) if x2.shape[0] == 2 else cfg
    out = _launch(kernel, cfg, x2, N, K, K // 2, gpb * group_size // 2, bias, x.dtype, args, norm, GS=group_size, GPB=gpb, GATED=gated,
                  **extra)
    return out.view(*x.shape[:-1], N)


def supports(kind: str, K: int, group: int) -> bool:
    """Shapes the GEMVs take: int8 groups/chunks of a power of two dividing K; 4-bit groups of 32..128."""
    if kind == "float":
        return True
    if kind == "int8":
        return group & (group - 1) == 0 and K % group == 0
    return group in (32, 64, 128)


# -- the choice ----------------------------------------------------------------------------------------
_CHOICE: dict[tuple, tuple[str, Config]] = {}  # (kind, N, K, group, dtype) -> ("gemv" | "gemv-words" | "gemv-mma" | "tiled" | "cublas" | "gemv-a8" | "rounded", config)
DEFAULT = {"float": "cublas", "int8": "gemv", "int4": "gemv"}


FUSING = ("float", "int8", "int4")  # the kinds whose GEMVs can make SiLU·mul or the norm before them
_GATED: dict[tuple, bool] = {}  # a down projection's shape key -> its GEMV makes SiLU·mul itself (timed faster than the SiLU kernel + the GEMV)
_NORMED: dict[tuple, bool] = {}  # a normed linear's shape key -> its GEMV makes the RMSNorm itself (timed faster than the norm kernel + the GEMV)


def shape_key(kind: str, N: int, K: int, group: int, dtype: torch.dtype, variant: str | None = None) -> tuple:
    """The key tune() times a linear under and the dispatch looks up. variant: "mins" (int8 weights
    with mins), "sym" / "super" (4-bit without mins / with factored scales: _int4_variant), each
    timed on its own."""
    return (kind, N, K, group, dtype) + ((variant,) if variant else ())


def choice(kind: str, N: int, K: int, group: int, dtype: torch.dtype, variant: str | None = None) -> tuple[str, Config]:
    return _CHOICE.get(shape_key(kind, N, K, group, dtype, variant), (DEFAULT[kind], DEFAULT_CONFIG))


def _rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def chosen_float(x, weight, bias=None, gated: bool = False, norm: Norm | None = None) -> torch.Tensor | None:
    """The float linear by the GEMV tune() chose for its shape; None where cuBLAS serves it (more
    rows than MAX_ROWS, or it was faster). gated, norm (here and below): as float_gemv's."""
    if _rows_of(x) <= MAX_ROWS:
        kernel, cfg = choice("float", *weight.shape, 0, x.dtype)
        if kernel == "gemv":
            return float_gemv(x, weight, bias, cfg, gated, norm)
    return None


def _choice_for(x, kind: str, N: int, K: int, group: int, variant: str | None, gated: bool, norm: Norm | None) -> tuple[str, Config]:
    """The kernel and config a linear of `kind` takes for x's rows: the one-row choice up to MAX_ROWS
    (where supports()), the batch choice ("<kind>rows", no fused norm or SiLU·mul there) up to
    BATCH_MAX_ROWS, else the tiled kernel."""
    rows = _rows_of(x)
    if rows <= MAX_ROWS:
        return choice(kind, N, K, group, x.dtype, variant) if supports(kind, K, group or 32) else ("tiled", DEFAULT_CONFIG)
    if rows <= BATCH_MAX_ROWS and norm is None and not gated:  # a decode batch: the MMA GEMV where tune() timed it faster
        return _CHOICE.get(shape_key(kind + "rows", N, K, group, x.dtype, variant), ("tiled", DEFAULT_CONFIG))
    return "tiled", DEFAULT_CONFIG


def chosen_int8(x, qweight, scale, bias=None, mins=None, gated: bool = False, norm: Norm | None = None) -> torch.Tensor | None:
    """The int8-weight linear by its chosen GEMV; None where the tiled kernel serves it."""
    N, K = qweight.shape
    group = K // scale.shape[1] if scale.dim() == 2 else 0
    kernel, cfg = _choice_for(x, "int8", N, K, group, "mins" if mins is not None else None, gated, norm)
    if kernel in ("gemv", "gemv-words"):
        return int8_gemv(x, qweight, scale, bias, cfg, mins, words=kernel == "gemv-words", gated=gated, norm=norm)
    if kernel == "gemv-mma":
        from .gemv_mma import int8_gemv_mma

        return int8_gemv_mma(x, qweight, scale, bias, cfg, mins, gated=gated, norm=norm)
    return None


def _int4_variant(mins, sups) -> str | None:
    """How a 4-bit linear's scales and mins are held, beyond floats of both: "sym" (no mins: Q4_0's),
    "super" (factored: a K-quant's), each timed on its own."""
    return "sym" if mins is None else "super" if sups is not None else None


def chosen_int4(x, packed, scales, mins, group_size, bias=None, gated: bool = False, norm: Norm | None = None, sups=None) -> torch.Tensor | None:
    """The 4-bit linear by its chosen GEMV; None where the tiled kernel serves it."""
    N, K = packed.shape[0], packed.shape[1] * 2
    kernel, cfg = _choice_for(x, "int4", N, K, group_size, _int4_variant(mins, sups), gated, norm)
    if kernel in ("gemv", "gemv-words"):
        return int4_gemv(x, packed, scales, mins, group_size, bias, cfg, words=kernel == "gemv-words", gated=gated, norm=norm, sups=sups)
    if kernel == "gemv-mma":
        from .gemv_mma import int4_gemv_mma

        return int4_gemv_mma(x, packed, scales, mins, group_size, bias, cfg, gated=gated, norm=norm, sups=sups)
    return None


def rounded_int8(x, qweight, scale, bias=None, mins=None) -> torch.Tensor:
    """The "gguf-a8" int8-weight linear without the integer GEMV: x rounded as the reference rounds
    it (in the model dtype), then the float-activation kernels (more rows than the GEMVs take)."""
    from ...ops import quantized

    xr = quantized.a8_input(x, qweight.shape[1] // scale.shape[1] if scale.dim() == 2 else None).to(x.dtype)
    out = chosen_int8(xr, qweight, scale, bias, mins)
    return out if out is not None else triton_linear.int8_weight_linear(xr, qweight, scale, bias, mins)


def rounded_int4(x, packed, scales, mins, group_size, bias=None, sups=None) -> torch.Tensor:
    """The "gguf-a8" 4-bit linear without the integer GEMV (as rounded_int8)."""
    from ...ops import quantized

    xr = quantized.a8_input(x, group_size).to(x.dtype)
    out = chosen_int4(xr, packed, scales, mins, group_size, bias, sups=sups)
    return out if out is not None else triton_linear.int4_weight_linear(xr, packed, scales, mins, group_size, bias, sups)


def chosen_int8_a8(x, qweight, scale, bias=None, mins=None) -> torch.Tensor | None:
    """The "gguf-a8" int8-weight linear by the integer GEMV in the config tune() chose; None for
    more rows or shapes it does not take, or where rounding x before the float-activation kernels
    timed faster."""
    from . import gemv_a8

    N, K = qweight.shape
    group = K // scale.shape[1] if scale.dim() == 2 else None
    if not gemv_a8.usable(x, 8, K, group, qweight):
        return None
    key = shape_key("int8a8", N, K, group or 0, x.dtype, "mins" if mins is not None else None)
    kernel, cfg = _CHOICE.get(key, ("gemv-a8", gemv_a8.DEFAULT_A8_CONFIG))
    return gemv_a8.int8_gemv_a8(x, qweight, scale, bias, mins, cfg) if kernel == "gemv-a8" else None


def chosen_int4_a8(x, packed, scales, mins, group_size, bias=None, sups=None) -> torch.Tensor | None:
    """The "gguf-a8" 4-bit linear by the integer GEMV (as chosen_int8_a8)."""
    from . import gemv_a8

    N, K = packed.shape[0], packed.shape[1] * 2
    if not gemv_a8.usable(x, 4, K, group_size, packed):
        return None
    key = shape_key("int4a8", N, K, group_size, x.dtype, _int4_variant(mins, sups))
    kernel, cfg = _CHOICE.get(key, ("gemv-a8", gemv_a8.DEFAULT_A8_CONFIG))
    return gemv_a8.int4_gemv_a8(x, packed, scales, mins, group_size, bias, cfg, sups) if kernel == "gemv-a8" else None


def _kind(module) -> str | None:
    """Which GEMVs a linear module's weights take: "float", "int8", "int4" (row layouts), "int8a8",
    "int4a8" (their weights under "gguf-a8": the integer GEMVs of gemv_a8.py), or None."""
    from ...model.llama import Linear
    from ...quant.linear import Int4Linear, Int8Linear
    from . import gemv_a8

    if type(module) is Linear and module.weight.is_floating_point():
        return "float"
    if isinstance(module, (Int8Linear, Int4Linear)) and module.int8_activations:
        bits = 8 if isinstance(module, Int8Linear) else 4
        return f"int{bits}a8" if not module.panels and gemv_a8.supports(bits, module.in_features, module.group_size) else None
    if isinstance(module, Int8Linear) and not module.panels and supports("int8", module.in_features, module.group_size or 32):
        return "int8"
    if isinstance(module, Int4Linear) and not module.panels:
        return "int4"
    return None


def _key(module, dtype: torch.dtype) -> tuple:
    """The shape key of a linear module that tune() and the dispatch share ((): no GEMV takes it)."""
    kind = _kind(module)
    if kind in ("int8", "int8a8"):
        return shape_key(kind, module.out_features, module.in_features, module.group_size or 0, dtype, "mins" if module.weight_min is not None else None)
    if kind in ("int4", "int4a8"):
        return shape_key(kind, module.out_features, module.in_features, module.group_size, dtype, _int4_variant(module.mins, module.sups))
    return shape_key("float", *module.weight.shape, 0, dtype) if kind else ()


def _module_gemv(module, x: torch.Tensor, gated: bool = False, norm: Norm | None = None) -> torch.Tensor | None:
    """A linear module applied by its chosen GEMV, or None (no GEMV chosen or possible; an integer
    GEMV makes neither SiLU·mul nor a norm)."""
    kind = _kind(module)
    if kind in ("int8a8", "int4a8"):
        if gated or norm is not None:
            return None
        if kind == "int8a8":
            return chosen_int8_a8(x, module.qweight, module.weight_scale, module.bias, module.weight_min)
        return chosen_int4_a8(x, module.qweight, module.scales, module.mins, module.group_size, module.bias, module.sups)
    if kind == "float":
        return chosen_float(x, module.weight, module.bias, gated, norm)
    if kind == "int8":
        return chosen_int8(x, module.qweight, module.weight_scale, module.bias, module.weight_min, gated, norm)
    if kind == "int4":
        return chosen_int4(x, module.qweight, module.scales, module.mins, module.group_size, module.bias, gated, norm, module.sups)
    return None


def _hooked(*modules) -> bool:
    """Whether hooks watch any of these modules (calibration's do): a fused kernel would hide the
    input they watch."""
    return any(m._forward_pre_hooks or m._forward_hooks for m in modules)


def silu_and_mul_linear(gate_up: torch.Tensor, down) -> torch.Tensor | None:
    """down(SiLU(gate) * up) in one GEMV where tune() found that faster than the SiLU·mul kernel
    before the GEMV (the small decode GEMVs, whose time is launches and latency); else None."""
    if _rows_of(gate_up) > MAX_ROWS or _hooked(down) or not _GATED.get(_key(down, gate_up.dtype)):
        return None
    return _module_gemv(down, gate_up, gated=True)


def rms_norm_linear(h: torch.Tensor, residual: torch.Tensor | None, norm, linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(linear(RMSNorm(h + residual)), h + residual) in one GEMV where tune() found that faster than
    the norm kernel before the GEMV: its programs make the normed rows (ops.rms_norm_linear); else
    None."""
    from ...model.llama import RMSNorm

    if _rows_of(h) > MAX_ROWS or type(norm) is not RMSNorm or _hooked(norm, linear) or not _NORMED.get(_key(linear, h.dtype)):
        return None
    h2 = h.reshape(-1, h.shape[-1]).contiguous()
    res_out = torch.empty_like(h2) if residual is not None else h2
    y = _module_gemv(linear, h2, norm=Norm(residual, norm.weight, norm.eps, res_out))
    return None if y is None else (y.view(*h.shape[:-1], y.shape[-1]), res_out.view(h.shape))


def _time(fn, calls: int = 10, replays: int = 5) -> float:
    """Milliseconds a call, launched from a CUDA graph as decode steps launch it (timed eagerly,
    the host's launch overhead would decide: Triton's launcher costs more than cuBLAS's)."""
    fn()  # compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def _candidates(module, x: torch.Tensor) -> tuple[tuple, dict]:
    """(shape key, {(kernel, config): call}) for one linear module at activation x."""
    kind, key = _kind(module), _key(module, x.dtype)
    if kind in ("int8a8", "int4a8"):  # (first: x rounded, then what serves the float-activation op)
        from . import gemv_a8

        if kind == "int8a8":
            q, s, m = module.qweight, module.weight_scale, module.weight_min
            fns = {("gemv-a8", c): (lambda c=c: gemv_a8.int8_gemv_a8(x, q, s, mins=m, cfg=c)) for c in gemv_a8.A8_CONFIGS}
            return key, {("rounded", DEFAULT_CONFIG): lambda: rounded_int8(x, q, s, mins=m), **fns}
        args, sups = (module.qweight, module.scales, module.mins, module.group_size), module.sups
        fns = {("gemv-a8", c): (lambda c=c: gemv_a8.int4_gemv_a8(x, *args, cfg=c, sups=sups)) for c in gemv_a8.A8_CONFIGS}
        return key, {("rounded", DEFAULT_CONFIG): lambda: rounded_int4(x, *args, sups=sups), **fns}
    if kind == "float":
        w = module.weight
        fns = {("gemv", c): (lambda c=c: float_gemv(x, w, cfg=c)) for c in CONFIGS}
        return key, {("cublas", DEFAULT_CONFIG): lambda: F.linear(x, w), **fns}
    if kind == "int8":
        q, s, m = module.qweight, module.weight_scale, module.weight_min
        fns = {("gemv", c): (lambda c=c: int8_gemv(x, q, s, cfg=c, mins=m)) for c in CONFIGS}
        fns.update({("gemv-words", c): (lambda c=c: int8_gemv(x, q, s, cfg=c, mins=m, words=True)) for c in INT8_WORD_CONFIGS})
        from . import gemv_mma

        if gemv_mma.supports(module.in_features, module.group_size or 32, x.dtype):
            fns.update({("gemv-mma", c): (lambda c=c: gemv_mma.int8_gemv_mma(x, q, s, cfg=c, mins=m))
                        for c in gemv_mma.fitting(gemv_mma.MMA_CONFIGS, module.group_size or 32, 8, 1)})
        return key, {("tiled", DEFAULT_CONFIG): lambda: triton_linear.int8_weight_linear(x, q, s, mins=m), **fns}
    if kind == "int4":
        args, sups = (module.qweight, module.scales, module.mins, module.group_size), module.sups
        fns = {("gemv", c): (lambda c=c: int4_gemv(x, *args, cfg=c, sups=sups)) for c in CONFIGS}
        fns.update({("gemv-words", c): (lambda c=c: int4_gemv(x, *args, cfg=c, words=True, sups=sups)) for c in WORD_CONFIGS})
        from . import gemv_mma

        if gemv_mma.supports(module.in_features, module.group_size, x.dtype):
            fns.update({("gemv-mma", c): (lambda c=c: gemv_mma.int4_gemv_mma(x, *args, cfg=c, sups=sups))
                        for c in gemv_mma.fitting(gemv_mma.MMA_CONFIGS, module.group_size, 4, 1)})
        return key, {("tiled", DEFAULT_CONFIG): lambda: triton_linear.int4_weight_linear(x, *args, sups=sups), **fns}
    return (), {}


BATCH_ROWS = 8  # the decode batch at which tune() times the kernels for 3..16 rows


def _batch_candidates(module, x: torch.Tensor, rows: int = BATCH_ROWS) -> tuple[tuple, dict]:
    """(shape key, {(kernel, config): call}) for an int8 or 4-bit linear at a decode batch of `rows`
    rows of x's type: the tiled kernel or the MMA GEMV (gemv_mma.py), which then serves 3..16 rows."""
    from . import gemv_mma

    kind = _kind(module)
    xb = torch.randn(rows, module.in_features, dtype=x.dtype, device=x.device)
    if kind == "int4" and gemv_mma.supports(module.in_features, module.group_size, x.dtype):
        args, sups = (module.qweight, module.scales, module.mins, module.group_size), module.sups
        key = shape_key("int4rows", module.out_features, module.in_features, module.group_size, x.dtype, _int4_variant(module.mins, sups))
        fns = {("gemv-mma", c): (lambda c=c: gemv_mma.int4_gemv_mma(xb, *args, cfg=c, sups=sups))
               for c in gemv_mma.fitting(gemv_mma.BATCH_CONFIGS, module.group_size, 4, 3)}
        return key, {("tiled", DEFAULT_CONFIG): lambda: triton_linear.int4_weight_linear(xb, *args, sups=sups), **fns}
    if kind == "int8" and gemv_mma.supports(module.in_features, module.group_size or 32, x.dtype):
        q, s, m = module.qweight, module.weight_scale, module.weight_min
        key = shape_key("int8rows", module.out_features, module.in_features, module.group_size or 0, x.dtype, "mins" if m is not None else None)
        fns = {("gemv-mma", c): (lambda c=c: gemv_mma.int8_gemv_mma(xb, q, s, mins=m, cfg=c))
               for c in gemv_mma.fitting(gemv_mma.BATCH_CONFIGS, module.group_size or 32, 8, 3)}
        return key, {("tiled", DEFAULT_CONFIG): lambda: triton_linear.int8_weight_linear(xb, q, s, mins=m), **fns}
    return (), {}


def _serves_rows(module, name: tuple[str, Config], key: tuple, x: torch.Tensor, batch: bool) -> bool:
    """Whether the candidate timed fastest (at one row, or at BATCH_ROWS) also compiles and agrees
    with its shape's reference (the first candidate: cuBLAS or the tiled kernel) at the other rows
    it serves, each a kernel of its own: up to MAX_ROWS (two rows a program, two padded MMA rows),
    or the MMA GEMV's row paddings 4 and 16."""
    for rows in (4, BATCH_MAX_ROWS) if batch else (MAX_ROWS,):
        xr = torch.randn(rows, x.shape[-1], dtype=x.dtype, device=x.device)
        fns = (_batch_candidates(module, x, rows) if batch else _candidates(module, xr))[1]
        reference = next(iter(fns))
        if name != reference and name not in _checked(key + (rows,), {reference: fns[reference], name: fns[name]}):
            return False
    return True


REJECTED: list[str] = []  # candidates tune() left out: "shape kernel(config): why"


def _checked(key: tuple, fns: dict) -> dict:
    """The candidates that compile and agree with the first one (cuBLAS or the tiled kernel, the
    established path) to within bf16 rounding: a kernel new to a chip must not win by being wrong."""
    kept, ref = {}, None
    for name, fn in fns.items():
        try:
            out = fn().float()
        except Exception as e:  # noqa: BLE001 -- a compile or launch failure drops this candidate only
            REJECTED.append(f"{key} {name}: {type(e).__name__}: {e}"[:300])
            continue
        if ref is None:
            ref = out
        elif not torch.isfinite(out).all() or (out - ref).norm() > 1e-2 * ref.norm():
            REJECTED.append(f"{key} {name}: relative error {((out - ref).norm() / ref.norm()).item():.3g}")
            continue
        kept[name] = fn
    return kept


def tune(model: torch.nn.Module, dtype: torch.dtype) -> dict[tuple, dict[str, float]]:
    """Time each candidate kernel and config for every distinct linear shape of the model at one
    activation row and remember the fastest, then for each MLP's down projection whether its GEMV
    should make SiLU·mul itself and for each linear after a norm whether its GEMV should make the
    norm; returns {shape: {kernel/config: ms}} (CUDA only)."""
    from ...model.llama import RMSNorm, SiluAndMul

    device = model.norm.weight.device
    timings: dict[tuple, dict[str, float]] = {}
    with torch.inference_mode():
        for module in model.modules():
            in_features = getattr(module, "in_features", None)
            if in_features is None:
                continue
            x = torch.randn(1, in_features, dtype=dtype, device=device)
            for key, fns in (_candidates(module, x), _batch_candidates(module, x)):
                if not fns or key in timings or key in _CHOICE:
                    continue
                ms = {name: _time(fn) for name, fn in _checked(key, fns).items()}
                if not ms:
                    continue
                _CHOICE[key] = min(ms, key=ms.get)
                if not _serves_rows(module, _CHOICE[key], key, x, batch=key[0].endswith("rows")):
                    _CHOICE[key] = next(iter(fns))  # (cuBLAS or the tiled kernel)
                timings[key] = {f"{name}{tuple(cfg) if name.startswith('gemv') else ''}": t for (name, cfg), t in ms.items()}
        for mlp in (m for m in model.modules() if type(getattr(m, "act", None)) is SiluAndMul):
            key = _key(mlp.down_proj, dtype)
            if key and key[0] in FUSING and key not in _GATED:
                _GATED[key] = _time_gated(mlp.down_proj, key, timings.setdefault(key, {}), device, dtype)
        for layer in getattr(model, "layers", ()):
            for norm, linear in layer.normed_linears():
                key = _key(linear, dtype)
                if key and key[0] in FUSING and key not in _NORMED and type(norm) is RMSNorm:
                    _NORMED[key] = _time_normed(norm, linear, key, timings.setdefault(key, {}), device, dtype)
    return timings


def _time_fused(key: tuple, timings: dict, fns_at: Callable[[int], dict]) -> bool:
    """Whether the fused call (fns' second) beats the two launches it replaces (the first), both timed
    from a CUDA graph into `timings` at one row; False where no GEMV serves the shape, or the fused
    one fails or differs by more than bf16 rounding (said in REJECTED), at one row or at the others
    it serves, up to MAX_ROWS (kernels of their own). fns_at(rows): the two calls at that many rows."""
    fns = fns_at(1)
    unfused, fused = fns
    if fns[unfused]() is None:
        return False
    kept = _checked(key, fns)
    if fused not in kept:
        return False
    timings[unfused], timings[fused] = _time(kept[unfused]), _time(kept[fused])
    return timings[fused] < timings[unfused] and fused in _checked(key + (MAX_ROWS,), fns_at(MAX_ROWS))


def _time_gated(down, key: tuple, timings: dict, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether down's chosen GEMV making SiLU·mul itself beats the SiLU·mul kernel before it."""
    from ... import ops

    def fns_at(rows: int) -> dict:
        gate_up = torch.randn(rows, 2 * down.in_features, dtype=dtype, device=device)
        return {"silu+gemv": lambda: _module_gemv(down, ops.silu_and_mul(gate_up)), "gated gemv": lambda: _module_gemv(down, gate_up, gated=True)}

    return _time_fused(key, timings, fns_at)


def _time_normed(norm, linear, key: tuple, timings: dict, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear's chosen GEMV making the add + RMSNorm before it itself beats the norm kernel."""

    def fns_at(rows: int) -> dict:
        h, residual = (torch.randn(rows, linear.in_features, dtype=dtype, device=device) for _ in range(2))
        res_out = torch.empty_like(h)
        return {"norm+gemv": lambda: _module_gemv(linear, norm(h, residual)[0]),
                "normed gemv": lambda: _module_gemv(linear, h, norm=Norm(residual, norm.weight, norm.eps, res_out))}

    return _time_fused(key, timings, fns_at)
