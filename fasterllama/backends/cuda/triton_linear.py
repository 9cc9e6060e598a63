"""Triton kernels for the quantized linears on CUDA, with the semantics of the reference ops of the
same names in fasterllama/ops/quantized.py, reading the weights in exactly those layouts.

Why these kernels:
- Decode (M = 1..64 rows) is memory-bound: what matters is streaming the int8/int4 weights at HBM
  speed, never materializing a float copy. For M <= a few rows a GEMV-style kernel (no tl.dot)
  owns BLOCK_N output rows, walks K, dequantizes each weight tile once in registers and uses it
  for every row of x. Beyond that the FP32 pipe becomes the limit (M multiply-adds per weight),
  so a tiled kernel hands the multiply to the tensor cores: tl.dot with the weight tile
  dequantized to the activation dtype in registers (BLOCK_M = 16 for decode, 128 for prefill);
  fp32 activations use 3xTF32, about fp32's accuracy (tl.dot's "ieee" runs on the FMA units and
  spills registers at these tiles).
- Weights become floats through their bit patterns (2^23 + q as an fp32, minus 2^23): an integer
  op and an fp add instead of an int-to-float conversion, which issues at 1/8 of the FP32 rate
  and would cap an int4 GEMV near half the memory bandwidth.
- Few output tiles (N = 4096 is 64 tiles of 64 rows for 132 SMs) get split-K: each K slice
  writes fp32 (or, for int8 x int8, exact int32) partials and a small second kernel sums them in
  a fixed order and applies the bias (and the W8A8 scales): deterministic, no atomics, no
  zero-fill. One slice writes the output directly.
- Prefill (M >= DEQUANT_MIN_M rows) is compute-bound, where cuBLAS's float GEMM beats a Triton
  kernel that dequantizes each tile per block of rows: the weight is written out in the
  activation dtype into one reused buffer (one layer's weight at a time; the model's stay
  quantized), then F.linear, as vLLM's AWQ linear does from 256 tokens.
- int8_gemm_dequant runs int8 x int8 on the tensor cores into an int32 accumulator for any M
  (cuBLASLt's int8 GEMM needs M > 16) and fuses the per-token/per-channel dequantization.
- Configs come from a small heuristic on M, N, K (no autotuning: compile time matters), and
  launchers only allocate and launch (no host syncs), so they can be captured in CUDA graphs.

Under TRITON_INTERPRET=1 (CPU tensors, used by the tests) float tiles are cast to fp32 before
tl.dot: the interpreter's bf16/fp16 dot is wrong.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...ops import quantized
from . import pdl
from .launch import cdiv, next_power_of_2

# GEMV kernels up to these row counts; above, tl.dot (an int4 weight costs twice the ALU work).
GEMV_MAX_M_INT8 = 4
GEMV_MAX_M_INT4 = 2
_GEMV_BLOCK_N = 64
_GEMV_BLOCK_K = 128  # weights (int4: 64 bytes) per row per step
_GROUP_M = 8  # tile swizzle: GROUP_M row tiles walk the same weight tiles, sharing them in L2
_REDUCE_BLOCK = 1024
# From this many rows (a prefill) a quantized linear writes its weight out once in the activation
# dtype and multiplies with cuBLAS. The tiled kernels dequantize every weight tile once per block of
# 128 rows: on an H200 they ran a 2,048-token prefill at 25% (4-bit) and 41% (int8) of the matmul
# rate against cuBLAS bf16's 77%; writing the float weight costs 2.5-3 bytes a weight, which a GEMM
# of ~100-250 rows already repays. Above the largest CUDA-graph bucket (256), so captured decode
# steps never take it.
DEQUANT_MIN_M = 512
_FLOAT_WEIGHT: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # the reused buffer, per device and dtype


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: size grids as for an H100
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: 3xTF32 for fp32 activations (see above); 16-bit ones ignore it."""
    return "tf32x3" if dtype == torch.float32 else "ieee"


def _split_k(tiles: int, k_blocks: int, target_programs: int) -> tuple[int, int]:
    """(K blocks per slice, slices): enough slices that tiles * slices reaches target_programs,
    with no empty slice."""
    want = max(1, min(k_blocks, cdiv(target_programs, tiles)))
    per = cdiv(k_blocks, want)
    return per, cdiv(k_blocks, per)


def _dot_config(M: int, int8_operands: bool = False, fp32: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the tl.dot kernels. Decode sizes keep
    BLOCK_N * BLOCK_K small (the dequantized tile lives in registers) and BLOCK_N >= M so that
    re-reading x costs less than the weights; prefill takes 128 x 128 tiles. fp32 activations
    (3xTF32: split operands, three products) need 8 warps not to spill registers."""
    if M <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
    elif M <= 32:
        block_m, block_n, block_k, warps, stages = 32, 64, 128, 4, 4
    elif M <= 64:
        block_m, block_n, block_k, warps, stages = 64, 128, 128 if int8_operands else 64, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 128 if int8_operands else 64, 8, 3
    return block_m, block_n, block_k, 8 if fp32 else warps, stages


def _buffers(M: int, N: int, splits: int, dtype: torch.dtype, part_dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The output, and what the main kernel writes: the output itself or [splits, M, N] partials."""
    out = torch.empty(M, N, dtype=dtype, device=device)
    return out, out if splits == 1 else torch.empty(splits, M, N, dtype=part_dtype, device=device)


def _reduce(part: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> None:
    """Sum split-K partials into out (a no-op without split-K), with the scales and the bias."""
    if part is out:
        return
    M, N = out.shape
    dummy = out
    _splitk_reduce_kernel[(cdiv(M * N, _REDUCE_BLOCK),)](
        part, out, dummy if bias is None else bias, dummy if x_scale is None else x_scale, dummy if w_scale is None else w_scale,
        M, N, part.shape[0], HAS_BIAS=bias is not None, HAS_SCALES=x_scale is not None, BLOCK=_REDUCE_BLOCK, num_warps=4,
        **pdl.launch_args(out),
    )


# -- shared pieces ------------------------------------------------------------------------------------
@triton.jit
def _s8_to_f32(q):
    """int8 -> fp32 as the bit pattern of 2^23 + 128 + q, minus that offset: no I2F conversion."""
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _u4_to_f32(q):
    """A nibble 0..15 (or any value below 2^23: a K-quant's sub-block byte) held in an int32 ->
    fp32, the same way."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (row tile, column tile), GROUP_M row tiles at a time (L2 reuse of weights)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * tiles_n)) % rows, (pid % (GROUP_M * tiles_n)) // rows


@triton.jit
def _store(out_ptr, acc, offs_m, offs_n, M, N, b_ptr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (+ bias) -> out [M, N] in out's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, out_ptr, b_ptr, xs_ptr, ws_ptr, M, N, SPLITS, HAS_BIAS: tl.constexpr, HAS_SCALES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = sum over slices of part [SPLITS, M, N] (in part's dtype: int32 stays exact), then
    (* x_scale[m] * w_scale[n]) (+ bias[n]), in that order, as dequantize_gemm does."""
    pdl.wait_prior(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0)
    n = offs % N
    y = acc.to(tl.float32)
    if HAS_SCALES:
        y = y * tl.load(xs_ptr + offs // N, mask=mask, other=0.0) * tl.load(ws_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# -- prefill: the weight written out in float once, then cuBLAS -----------------------------------------
def _float_weight(N: int, K: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [N, K] view of the reused buffer (kernels on one stream run in order: the next linear's
    dequantization writes it after this one's GEMM has read it)."""
    buf = _FLOAT_WEIGHT.get((device, dtype))
    if buf is None or buf.numel() < N * K:
        _FLOAT_WEIGHT[(device, dtype)] = buf = torch.empty(N * K, dtype=dtype, device=device)
    return buf[: N * K].view(N, K)


def _dequantize_first(M: int) -> bool:
    return M >= DEQUANT_MIN_M and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@triton.jit
def _q4_factors(sm, sup):
    """(scales, mins) fp32 from the words q4_params reads: sub-block scale and min bytes (sm) times
    d and -dmin's fp16 bits (sup, each already beside its groups)."""
    d = (sup & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dm = (sup >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return _u4_to_f32(sm & 0xFF) * d, _u4_to_f32((sm >> 8) & 0xFF) * dm


@triton.jit
def q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, rows, g, mask, G, HAS_MINS: tl.constexpr, GPS: tl.constexpr):
    """The fp32 scales and mins [rows, groups] of a 4-bit tile's groups g of rows `rows`: stored
    floats; or (GPS > 0: a K-quant's factored form, Q4_K's: Int4Linear.factors) each group's
    sub-block scale and min, two bytes side by side read as one 16-bit word (s_ptr), times its
    super-block's d and -dmin (GPS groups), two fp16 side by side read as one 32-bit word (ss_ptr):
    4.6 bits a weight instead of 6; without mins (Q4_0's symmetric groups, w = scale * (q - 8):
    compact_scales drops their stored -8 * scale) -8 * scale, no bytes read."""
    off = rows[:, None] * G + g[None, :]
    if GPS > 0:
        sm = tl.load(s_ptr.to(tl.pointer_type(tl.int16)) + off, mask=mask, other=0).to(tl.int32)
        sup = tl.load(ss_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (G // GPS) + (g // GPS)[None, :], mask=mask, other=0)
        return _q4_factors(sm, sup)
    s = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_MINS:
        mn = tl.load(mn_ptr + off, mask=mask, other=0.0).to(tl.float32)
    else:
        mn = -8.0 * s
    return s, mn


@triton.jit
def _int8_dequant_kernel(w_ptr, s_ptr, mn_ptr, out_ptr, N, K, G, PER_GROUP: tl.constexpr, GS: tl.constexpr, HAS_MINS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out = q * scale (+ min), scales per output channel or per group of GS columns."""
    pdl.wait_prior(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    at = offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    w = _s8_to_f32(tl.load(w_ptr + at, mask=ok, other=0))
    if PER_GROUP:
        g = offs_n.to(tl.int64)[:, None] * G + (offs_k // GS)[None, :]
        w = w * tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
        if HAS_MINS:
            w += tl.load(mn_ptr + g, mask=ok, other=0.0).to(tl.float32)
    else:
        w = w * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + at, w.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _int4_dequant_kernel(p_ptr, s_ptr, mn_ptr, out_ptr, N, K, GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
                         HAS_MINS: tl.constexpr = True, ss_ptr=None, ms_ptr=None, GPS: tl.constexpr = 0):
    """out = q * scale + min from pack_int4's bytes: byte j of a group holds values j (low nibble)
    and GS/2 + j (high)."""
    pdl.wait_prior(PDL)
    HALF: tl.constexpr = GS // 2
    KB = K // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = (offs_n < N)[:, None] & (offs_b < KB)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    p = tl.load(p_ptr + rows * KB + offs_b[None, :], mask=ok, other=0).to(tl.int32)
    s, mn = q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n.to(tl.int64), offs_b // HALF, ok, K // GS, HAS_MINS, GPS)
    k_lo = rows * K + ((offs_b // HALF) * GS + offs_b % HALF)[None, :]
    tl.store(out_ptr + k_lo, (_u4_to_f32(p & 15) * s + mn).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + k_lo + HALF, (_u4_to_f32(p >> 4) * s + mn).to(out_ptr.dtype.element_ty), mask=ok)


# -- int8 weights, float activations --------------------------------------------------------------------
@triton.jit
def _int8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, M, N, K, G, stride_xm, k_split,
    PER_GROUP: tl.constexpr, GS: tl.constexpr, GPB: tl.constexpr, GS_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MINS: tl.constexpr, PDL: tl.constexpr,
):
    """Rows [pid_n * BLOCK_N, +BLOCK_N) of x @ (q * s + min)^T over K slice pid_k, for all M <=
    BLOCK_M rows of x. A weight tile is [BLOCK_N, GPB, GS_T]: GPB runs of GS_T columns, each inside
    one scale group of GS columns (per channel: one run, the scale applied at the end); a run's
    min term is min * sum(x over the run)."""
    pdl.wait_prior(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BLOCK_K: tl.constexpr = GPB * GS_T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_g = tl.arange(0, GPB)
    offs_t = offs_g[:, None] * GS_T + tl.arange(0, GS_T)[None, :]
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # rows of out as columns: no layout change
    k_start = pid_k * k_split
    for k0 in range(k_start, k_start + k_split, BLOCK_K):
        k = k0 + offs_t
        k_ok = k < K
        w = tl.load(w_ptr + offs_n[:, None, None] * K + k[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0)
        w = _s8_to_f32(w)
        if PER_GROUP:
            kg = k0 + offs_g * GS_T
            s = tl.load(s_ptr + offs_n[:, None] * G + (kg // GS)[None, :], mask=n_ok[:, None] & (kg < K)[None, :], other=0.0)
            if HAS_MINS:
                mn = tl.load(mn_ptr + offs_n[:, None] * G + (kg // GS)[None, :], mask=n_ok[:, None] & (kg < K)[None, :], other=0.0)
        for m in tl.static_range(BLOCK_M):  # the weight tile stays in registers for every row
            xv = tl.load(x_ptr + m * stride_xm + k, mask=k_ok & (m < M), other=0.0).to(tl.float32)
            r = tl.sum(w * xv[None, :, :], axis=2)
            if PER_GROUP:
                r = r * s
                if HAS_MINS:
                    r += mn * tl.sum(xv, axis=1)[None, :]
            acc = tl.where(rows[None, :] == m, acc + tl.sum(r, axis=1)[:, None], acc)
    if not PER_GROUP:
        acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    _store(out_ptr + pid_k * M * N, tl.trans(acc), rows, offs_n, M, N, b_ptr, HAS_BIAS)


@triton.jit
def _int8_linear_kernel(
    x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, M, N, K, G, stride_xm, k_split,
    PER_GROUP: tl.constexpr, GS: tl.constexpr, GPB: tl.constexpr, GS_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MINS: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """The tl.dot version: the weight tile (laid out as in the GEMV kernel) is dequantized to the
    activation dtype (exactly, per channel: the scale comes in the epilogue) and multiplied on
    the tensor cores with an fp32 accumulator."""
    pdl.wait_prior(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    BLOCK_K: tl.constexpr = GPB * GS_T
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_g = tl.arange(0, GPB)
    offs_t = offs_g[:, None] * GS_T + tl.arange(0, GS_T)[None, :]
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_split
    for k0 in range(k_start, k_start + k_split, BLOCK_K):
        xk = k0 + offs_k
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + xk[None, :], mask=m_ok[:, None] & (xk < K)[None, :], other=0.0)
        if INTERPRET:
            xt = xt.to(tl.float32)
        k = k0 + offs_t
        w = tl.load(w_ptr + offs_n[:, None, None] * K + k[None, :, :], mask=n_ok[:, None, None] & (k < K)[None, :, :], other=0)
        w = _s8_to_f32(w)
        if PER_GROUP:
            kg = k0 + offs_g * GS_T
            s = tl.load(s_ptr + offs_n[:, None] * G + (kg // GS)[None, :], mask=n_ok[:, None] & (kg < K)[None, :], other=0.0)
            w = w * s[:, :, None]
            if HAS_MINS:
                w += tl.load(mn_ptr + offs_n[:, None] * G + (kg // GS)[None, :], mask=n_ok[:, None] & (kg < K)[None, :], other=0.0)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(xt.dtype)
        acc = tl.dot(xt, tl.trans(w), acc, input_precision=PRECISION)
    if not PER_GROUP:
        acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    _store(out_ptr + pid_k * M * N, acc, offs_m, offs_n, M, N, b_ptr, HAS_BIAS)


def int8_weight_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       mins: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (q * scale + min)^T (+ bias) -> [..., N] in x.dtype, for int8 q [N, K] and fp32
    scales per output channel [N] or per group of K/G input columns [N, G] (G > 1: K/G a power of
    two), with fp32 mins [N, G] or none."""
    N, K = qweight.shape
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    s = scale.reshape(N, -1).contiguous()
    G = s.shape[1]
    per_group = G > 1
    gs = K // G
    if per_group:
        assert gs * G == K and gs & (gs - 1) == 0, f"per-group scales need a power-of-two group, got K={K}, G={G}"
    assert mins is None or (per_group and mins.shape == s.shape), "mins need per-group scales"
    if M == 0:
        return x.new_empty(*x.shape[:-1], N)
    qweight = qweight.contiguous()
    if _dequantize_first(M):
        w = _float_weight(N, K, x.dtype, x.device)
        _int8_dequant_kernel[(cdiv(N, 32), cdiv(K, 256))](
            qweight, s, s if mins is None else mins.contiguous(), w, N, K, G, PER_GROUP=per_group, GS=gs if per_group else 1,
            HAS_MINS=mins is not None, BLOCK_N=32, BLOCK_K=256, num_warps=4, **pdl.launch_args(w))
        return F.linear(x2, w, bias).view(*x.shape[:-1], N)
    gemv = M <= GEMV_MAX_M_INT8
    if gemv:
        block_m, block_n, block_k, warps, stages = next_power_of_2(M), _GEMV_BLOCK_N, _GEMV_BLOCK_K, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = _dot_config(M, fp32=x.dtype == torch.float32)
    gs_t = min(gs, block_k) if per_group else block_k
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    per, splits = _split_k(tiles, cdiv(K, block_k), (4 if gemv else 2) * _num_sms(x.device))
    out, part = _buffers(M, N, splits, x.dtype, torch.float32, x.device)
    has_bias = bias is not None and splits == 1
    common = {"PER_GROUP": per_group, "GS": gs if per_group else 1, "GPB": block_k // gs_t, "GS_T": gs_t, "BLOCK_M": block_m, "BLOCK_N": block_n,
              "HAS_BIAS": has_bias, "HAS_MINS": mins is not None, "num_warps": warps, "num_stages": stages, **pdl.launch_args(x2)}
    args = (x2, qweight, s, s if mins is None else mins.contiguous(), bias if has_bias else s, part, M, N, K, G, x2.stride(0), per * block_k)
    if gemv:
        _int8_gemv_kernel[(cdiv(N, block_n), splits)](*args, **common)
    else:
        _int8_linear_kernel[(tiles, splits)](*args, GROUP_M=_GROUP_M, PRECISION=_precision(x.dtype), INTERPRET=_interpret(), **common)
    _reduce(part, out, bias)
    return out.view(*x.shape[:-1], N)


# -- int4 weights (pack_int4 layout), float activations -------------------------------------------------
@triton.jit
def _int4_gemv_kernel(
    x_ptr, p_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, M, N, K, stride_xm, kb_split,
    GS: tl.constexpr, GPB: tl.constexpr, HT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    HAS_MINS: tl.constexpr = True, ss_ptr=None, ms_ptr=None, GPS: tl.constexpr = 0,
):
    """Rows [pid_n * BLOCK_N, +BLOCK_N) over the byte slice pid_k, for all M <= BLOCK_M rows of x.
    A packed tile is [BLOCK_N, GPB, HT] bytes: GPB runs of HT bytes inside one group of GS values,
    whose low nibbles are the values at k = group * GS + j and high ones at k + GS/2. Per group,
    sum_k w x = scale * sum_k q x + min * sum_k x."""
    pdl.wait_prior(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = GS // 2
    BLOCK_KB: tl.constexpr = GPB * HT
    KB = K // 2
    G = K // GS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_g = tl.arange(0, GPB)
    offs_j = tl.arange(0, HT)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # rows of out as columns: no layout change
    b_start = pid_k * kb_split
    for b0 in range(b_start, b_start + kb_split, BLOCK_KB):
        run = b0 + offs_g * HT  # first byte of each run
        b = run[:, None] + offs_j[None, :]
        b_ok = b < KB
        p = tl.load(p_ptr + offs_n[:, None, None] * KB + b[None, :, :], mask=n_ok[:, None, None] & b_ok[None, :, :], other=0).to(tl.int32)
        lo = _u4_to_f32(p & 15)
        hi = _u4_to_f32(p >> 4)
        grp = run // HALF
        s, mn = q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, grp, n_ok[:, None] & (run < KB)[None, :], G, HAS_MINS, GPS)
        k_lo = (grp * GS + run % HALF)[:, None] + offs_j[None, :]
        for m in tl.static_range(BLOCK_M):  # the unpacked tile stays in registers for every row
            x_ok = b_ok & (m < M)
            xl = tl.load(x_ptr + m * stride_xm + k_lo, mask=x_ok, other=0.0).to(tl.float32)
            xh = tl.load(x_ptr + m * stride_xm + k_lo + HALF, mask=x_ok, other=0.0).to(tl.float32)
            r = tl.sum(lo * xl[None, :, :] + hi * xh[None, :, :], axis=2)
            r = r * s + mn * tl.sum(xl + xh, axis=1)[None, :]
            acc = tl.where(rows[None, :] == m, acc + tl.sum(r, axis=1)[:, None], acc)
    _store(out_ptr + pid_k * M * N, tl.trans(acc), rows, offs_n, M, N, b_ptr, HAS_BIAS)


@triton.jit
def _int4_linear_kernel(
    x_ptr, p_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, M, N, K, stride_xm, kb_split,
    GS: tl.constexpr, GPB: tl.constexpr, HT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    HAS_MINS: tl.constexpr = True, ss_ptr=None, ms_ptr=None, GPS: tl.constexpr = 0,
):
    """The tl.dot version: a packed tile (as in the GEMV kernel) becomes two dequantized weight
    tiles, the low and the high nibbles, each multiplied with the columns of x they stand for."""
    pdl.wait_prior(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = GS // 2
    BLOCK_KB: tl.constexpr = GPB * HT
    KB = K // 2
    G = K // GS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_g = tl.arange(0, GPB)
    offs_j = tl.arange(0, HT)
    offs_b = tl.arange(0, BLOCK_KB)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_start = pid_k * kb_split
    for b0 in range(b_start, b_start + kb_split, BLOCK_KB):
        xb = b0 + offs_b
        x_off = offs_m[:, None] * stride_xm + (xb + (xb // HALF) * HALF)[None, :]  # k of the low nibbles
        x_mask = m_ok[:, None] & (xb < KB)[None, :]
        xl = tl.load(x_ptr + x_off, mask=x_mask, other=0.0)
        xh = tl.load(x_ptr + x_off + HALF, mask=x_mask, other=0.0)
        if INTERPRET:
            xl = xl.to(tl.float32)
            xh = xh.to(tl.float32)
        run = b0 + offs_g * HT
        b = run[:, None] + offs_j[None, :]
        p = tl.load(p_ptr + offs_n[:, None, None] * KB + b[None, :, :], mask=n_ok[:, None, None] & (b < KB)[None, :, :], other=0).to(tl.int32)
        s, mn = q4_params(s_ptr, mn_ptr, ss_ptr, ms_ptr, offs_n, run // HALF, n_ok[:, None] & (run < KB)[None, :], G, HAS_MINS, GPS)
        s, mn = s[:, :, None], mn[:, :, None]
        wl = tl.reshape(_u4_to_f32(p & 15) * s + mn, [BLOCK_N, BLOCK_KB]).to(xl.dtype)
        wh = tl.reshape(_u4_to_f32(p >> 4) * s + mn, [BLOCK_N, BLOCK_KB]).to(xl.dtype)
        acc = tl.dot(xl, tl.trans(wl), acc, input_precision=PRECISION)
        acc = tl.dot(xh, tl.trans(wh), acc, input_precision=PRECISION)
    _store(out_ptr + pid_k * M * N, acc, offs_m, offs_n, M, N, b_ptr, HAS_BIAS)


def q4_args(scales: torch.Tensor, mins: torch.Tensor | None, sups: tuple[torch.Tensor, torch.Tensor | None] | None) -> tuple[tuple, dict]:
    """The 4-bit kernels' (s_ptr, mn_ptr) and their ss_ptr, ms_ptr, HAS_MINS, GPS (q4_params) for
    float scales and mins, mins None (Q4_0's), or a K-quant's factored form (sups = (scale_super,
    min_super)), whose sub-block scale and min, and d and -dmin, the kernels read in pairs side
    by side in memory (as compact_scales lays them out); pointers a kernel does not read are
    placeholders."""
    if sups is None:
        scales = scales.contiguous()
        return (scales, scales if mins is None else mins.contiguous()), {"HAS_MINS": mins is not None, "GPS": 0, "ss_ptr": scales, "ms_ptr": scales}
    ss, ms = sups
    assert mins is not None and ms is not None, "a factored form has mins"
    assert scales.dtype == mins.dtype == torch.int8 and ss.dtype == ms.dtype == torch.float16, "int8 sub-block values, fp16 super-block ones"
    if not (quantized.side_by_side(scales, mins) and quantized.side_by_side(ss, ms)):  # (a copy each call: compact_scales lays a model's out once)
        scales, mins = quantized.interleave(scales, mins)
        ss, ms = quantized.interleave(ss, ms)
    return (scales, mins), {"HAS_MINS": True, "GPS": scales.shape[1] // ss.shape[1], "ss_ptr": ss, "ms_ptr": ms}


def int4_weight_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                       bias: torch.Tensor | None = None, sups: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x.dtype, W = scale * q + min per group of group_size
    (a power of two) input columns, q in 0..15 packed by pack_int4 into uint8 [N, K/2]; mins None:
    Q4_0's symmetric groups, min = -8 * scale; sups: scales and mins in a K-quant's factored form
    (q4_args)."""
    N, G = scales.shape
    K = G * group_size
    assert packed.shape == (N, K // 2) and group_size >= 2 and group_size & (group_size - 1) == 0, "packed [N, K/2] in groups of 2^n values"
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*x.shape[:-1], N)
    packed = packed.contiguous()
    (scales, mins), q4 = q4_args(scales, mins, sups)
    if _dequantize_first(M):
        w = _float_weight(N, K, x.dtype, x.device)
        _int4_dequant_kernel[(cdiv(N, 32), cdiv(K // 2, 128))](packed, scales, mins, w, N, K, GS=group_size, BLOCK_N=32, BLOCK_B=128, num_warps=4,
                                                                               **q4, **pdl.launch_args(w))
        return F.linear(x2, w, bias).view(*x.shape[:-1], N)
    gemv = M <= GEMV_MAX_M_INT4
    if gemv:
        block_m, block_n, block_k, warps, stages = next_power_of_2(M), _GEMV_BLOCK_N, _GEMV_BLOCK_K, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = _dot_config(M, fp32=x.dtype == torch.float32)
    block_kb = block_k // 2
    ht = min(group_size // 2, block_kb)
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    per, splits = _split_k(tiles, cdiv(K // 2, block_kb), (4 if gemv else 2) * _num_sms(x.device))
    out, part = _buffers(M, N, splits, x.dtype, torch.float32, x.device)
    has_bias = bias is not None and splits == 1
    common = {"GS": group_size, "GPB": block_kb // ht, "HT": ht, "BLOCK_M": block_m, "BLOCK_N": block_n,
              "HAS_BIAS": has_bias, **q4, "num_warps": warps, "num_stages": stages, **pdl.launch_args(x2)}
    args = (x2, packed, scales, mins, bias if has_bias else scales, part, M, N, K, x2.stride(0), per * block_kb)
    if gemv:
        _int4_gemv_kernel[(cdiv(N, block_n), splits)](*args, **common)
    else:
        _int4_linear_kernel[(tiles, splits)](*args, GROUP_M=_GROUP_M, PRECISION=_precision(x.dtype), INTERPRET=_interpret(), **common)
    _reduce(part, out, bias)
    return out.view(*x.shape[:-1], N)


# -- W8A8: int8 activations x int8 weights -----------------------------------------------------------------
@triton.jit
def _int8_gemm_kernel(
    a_ptr, w_ptr, xs_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_am, k_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """Exact int32 xq @ qweight^T on the tensor cores over K slice pid_k; with EPILOGUE (one slice)
    dequantized in place, else stored as int32 partials for _splitk_reduce_kernel."""
    pdl.wait_prior(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    k_start = pid_k * k_split
    for k0 in range(k_start, k_start + k_split, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_ptr + offs_n[None, :] * K + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
    out_ptr += pid_k * M * N
    if EPILOGUE:
        y = acc.to(tl.float32) * tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
        y = y * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        _store(out_ptr, y, offs_m, offs_n, M, N, b_ptr, HAS_BIAS)
    else:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int8_gemm_tma_kernel(
    a_desc, w_desc, xs_ptr, ws_ptr, b_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """_int8_gemm_kernel's product and epilogue, persistent: the programs (one an SM) walk the
    output tiles, their operand tiles brought by the TMA engine (tensor descriptors: one copy
    instruction a tile, rows past M, N or K read as 0) and the K loop pipelined across a program's
    tiles (flatten), so one tile's loads overlap the last one's epilogue."""
    pdl.wait_prior(PDL)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):  # (the grid's size: not a constexpr, one compile for every M)
        pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y = acc.to(tl.float32) * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
        y = y * tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        _store(out_ptr, y, offs_m, offs_n, M, N, b_ptr, HAS_BIAS)


def _int8_gemm_tma(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor, config: tuple[int, int, int, int, int]) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    (M, K), N = xq.shape, qweight.shape[0]
    block_m, block_n, block_k, warps, stages = config
    programs = min(_num_sms(xq.device), cdiv(M, block_m) * cdiv(N, block_n))
    _int8_gemm_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(xq, [block_m, block_k]), TensorDescriptor.from_tensor(qweight, [block_n, block_k]),
        x_scale, w_scale, w_scale if bias is None else bias, out, M, N, K,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M, HAS_BIAS=bias is not None,
        num_warps=warps, num_stages=stages, **pdl.launch_args(xq),
    )


# W8A8 prefill tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) that tune_prefill() times per weight
# shape at 2,048 rows (sm_90: all wgmma with cp.async pipelines, no spills; 115, 195 and 208
# registers), and CUBLAS: cuBLASLt's int8 GEMM (torch._int_mm) into int32, then the reduce kernel's
# dequantization; a GEMM of PREFILL_ROWS rows or more takes the fastest, smaller ones _dot_config's.
# On an H200 (2026-11-30) the first tile won every 7B shape (~1.3 POP/s; cuBLAS took 1.6-1.8x its
# time, and 4-5 stages or 4 warps 1.15-1.7x) and cuBLAS three of SmolLM2-135M's four (0.6-0.9x).
# A config ending in TMA runs _int8_gemm_tma_kernel (persistent, operands by the TMA engine; not yet
# timed on a GPU), where K and the operands' addresses allow it (16-byte aligned rows).
CUBLAS, TMA = "cublas", "tma"
PrefillConfig = tuple[int, int, int, int, int] | tuple[int, int, int, int, int, str] | str
PREFILL_INT8_CONFIGS: tuple[PrefillConfig, ...] = (
    (128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), CUBLAS, (128, 128, 128, 8, 3, TMA), (128, 256, 128, 8, 3, TMA))
PREFILL_ROWS = 512
_PREFILL_INT8: dict[tuple[int, int], PrefillConfig] = {}  # (N, K) -> the fastest of PREFILL_INT8_CONFIGS


def int8_gemm_dequant(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                      config: PrefillConfig | None = None) -> torch.Tensor:
    """(int8 xq [M, K] @ int8 qweight [N, K]^T, exact in int32) * x_scale[m] * w_scale[n] (+ bias[n])
    -> out_dtype [M, N], for any M: dequantize_gemm(int8_gemm(xq, qweight.t()), ...), in one kernel
    but where K is split or config is CUBLAS (then a reduce kernel dequantizes)."""
    M, K = xq.shape
    N = qweight.shape[0]
    if M == 0:
        return torch.empty(0, N, dtype=out_dtype, device=xq.device)
    xq, qweight = xq.contiguous(), qweight.contiguous()
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    config = config or (_PREFILL_INT8.get((N, K)) if M >= PREFILL_ROWS else None) or _dot_config(M, int8_operands=True)
    if config == CUBLAS:  # (M > 16, K and N multiples of 8: tune_prefill rejects it where not)
        out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
        _reduce(torch._int_mm(xq, qweight.t()).unsqueeze(0), out, bias, x_scale, w_scale)
        return out
    if config[-1] == TMA:
        config = config[:5]
        if K % 16 == 0 and xq.data_ptr() % 16 == 0 and qweight.data_ptr() % 16 == 0:  # (both contiguous: rows K bytes apart)
            out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
            _int8_gemm_tma(xq, x_scale, qweight, w_scale, bias, out, config)
            return out
    block_m, block_n, block_k, warps, stages = config
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    per, splits = _split_k(tiles, cdiv(K, block_k), 2 * _num_sms(xq.device))
    out, part = _buffers(M, N, splits, out_dtype, torch.int32, xq.device)
    _int8_gemm_kernel[(tiles, splits)](
        xq, qweight, x_scale, w_scale, w_scale if bias is None else bias, part, M, N, K, xq.stride(0), per * block_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M, EPILOGUE=splits == 1, HAS_BIAS=bias is not None,
        num_warps=warps, num_stages=stages, **pdl.launch_args(xq),
    )
    _reduce(part, out, bias, x_scale, w_scale)
    return out


def tune_prefill(model: torch.nn.Module, rows: int = 2048) -> dict[tuple, dict[str, float]]:
    """Time PREFILL_INT8_CONFIGS for each distinct W8A8 weight shape of the model at `rows` rows
    (from a CUDA graph, as gemv.tune times) and remember the fastest for GEMMs of PREFILL_ROWS rows
    or more; and the quantizing SiLU·mul's two ways (triton_norm.tune_silu_quant). Returns
    {("w8a8 prefill", N, K, rows): {config: ms}, ("w8a8 silu quant", K, rows): {way: ms}} (CUDA only)."""
    from ...quant.linear import W8A8Linear
    from . import triton_norm

    timings: dict[tuple, dict[str, float]] = {}
    with torch.inference_mode():
        for module in model.modules():
            shape = (getattr(module, "out_features", 0), getattr(module, "in_features", 0))
            if isinstance(module, W8A8Linear) and shape not in _PREFILL_INT8:
                ms = _time_prefill_configs(module.qweight, module.weight_scale, rows)
                if ms:
                    _PREFILL_INT8[shape] = min(ms, key=ms.get)
                    timings[("w8a8 prefill", *shape, rows)] = {str(cfg): t for cfg, t in ms.items()}
        down = next((m for name, m in model.named_modules() if name.endswith("down_proj") and isinstance(m, W8A8Linear)), None)
        if down is not None:  # (its input: the quantizing SiLU·mul's output)
            timings.update(triton_norm.tune_silu_quant(down.in_features, model.norm.weight.dtype, down.qweight.device, rows))
    return timings


def _time_prefill_configs(qweight: torch.Tensor, w_scale: torch.Tensor, rows: int) -> dict[PrefillConfig, float]:
    """{config: ms} of the W8A8 GEMM at `rows` random int8 rows; a config that fails or differs from
    the first's output by more than bf16 rounding is left out (gemv._checked; REJECTED says why)."""
    from .gemv import _checked, _time

    xq = torch.randint(-127, 128, (rows, qweight.shape[1]), dtype=torch.int8, device=qweight.device)
    xs = torch.rand(rows, device=qweight.device) / 127
    fns = {cfg: (lambda cfg=cfg: int8_gemm_dequant(xq, xs, qweight, w_scale, None, torch.bfloat16, cfg)) for cfg in PREFILL_INT8_CONFIGS}
    return {cfg: _time(fn) for cfg, fn in _checked(("w8a8 prefill", *qweight.shape), fns).items()}
