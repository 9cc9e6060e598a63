"""Row-wise Triton kernels: RMSNorm (with the residual add before it fused in), SiLU·mul, and
FasterLLaMA's per-token INT8 quantization fused into either (resNormQuantized,
DequantizedResidualResNormQuantized's float half, DequantizedSiluMultifyQuantized's).

One program a row: the row is read once, and the residual sum, the normed row and its int8 form
leave in the same pass (the quantizing SiLU·mul of a prefill's rows goes in column chunks, its
output written once, with the row's absmax, and read back to be quantized). Each op computes what its PyTorch reference (ops/reference.py,
ops/quantized.py) computes, rounding at the same points (the norm in fp32, the weight product in
the model dtype), so bf16 results match the reference's bits except for rare last-place ties."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .launch import cdiv, next_power_of_2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_half_even(v):
    """torch.round: halves go to the even neighbour."""
    r = tl.floor(v + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - v) == 0.5) & odd, r - 1.0, r)


RCP_127 = tl.constexpr(0.007874015718698502)  # 1 / 127 in fp32, correctly rounded (numpy: float32(1) / float32(127))


FUSED_FMA = tl.constexpr(not INTERPRET)  # (the interpreter's tl.fma rounds the product, then the sum)


@triton.jit
def quotient(a, b, r):
    """a / b correctly rounded, as torch divides (Triton's "/" is PTX div.full: 2 ulp, so a scale or
    an int8 code at a near-tie could differ from torch's by one step), from r, the correctly rounded
    1 / b (one division a row): t = a r, then one FMA correction step (Markstein's theorem: the
    result is a / b rounded to nearest). The interpreter, whose "/" is numpy's, divides."""
    if FUSED_FMA:
        t = a * r
        return tl.fma(tl.fma(-t, b, a), r, t)
    return tl.div_rn(a, b)


@triton.jit
def _row_scale(amax, static_ptr, HAS_STATIC: tl.constexpr, CLIP: tl.constexpr):
    """A row's quantization scale from its absmax (and the calibrated static scale, if any)."""
    scale = quotient(tl.maximum(amax, 1e-12), 127.0, RCP_127)
    if HAS_STATIC:
        static = tl.load(static_ptr).to(tl.float32)
        if CLIP:
            scale = static
        else:  # a row beyond the calibrated range (an attention sink) keeps its own scale
            scale = tl.where(amax > static * 127.0, scale, static)
    return scale


@triton.jit
def _store_quantized(y, scale, cols, mask, q_ptr, row, K):
    q = tl.minimum(tl.maximum(_round_half_even(quotient(y, scale, tl.div_rn(1.0, scale))), -127.0), 127.0)
    tl.store(q_ptr + row * K + cols, q.to(tl.int8), mask=mask)


@triton.jit
def _quantize_row(y, cols, mask, q_ptr, scale_ptr, static_ptr, row, K, HAS_STATIC: tl.constexpr, CLIP: tl.constexpr):
    """quantize_per_token of one row y (fp32, already rounded to the model dtype)."""
    scale = _row_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0), static_ptr, HAS_STATIC, CLIP)
    _store_quantized(y, scale, cols, mask, q_ptr, row, K)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr, static_ptr, K, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, HAS_STATIC: tl.constexpr, CLIP: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # (a weight, which no kernel writes: on its way while the kernel before ends)
    pdl.wait_prior(PDL)
    dtype = x_ptr.dtype.element_ty  # arithmetic in fp32, rounded to the model dtype where torch rounds
    h = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = (h + tl.load(res_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * K + cols, h, mask=mask)
        h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
    normed = (h * rstd).to(dtype).to(tl.float32)
    y = (w.to(tl.float32) * normed).to(dtype)
    if QUANT:
        _quantize_row(y.to(tl.float32), cols, mask, q_ptr, scale_ptr, static_ptr, row, K, HAS_STATIC, CLIP)
    else:
        tl.store(out_ptr + row * K + cols, y, mask=mask)


@triton.jit
def silu_mul(g, up, dtype: tl.constexpr):
    """SiLU(g) * up (fp32 in) in `dtype`, rounded where the reference rounds: F.silu rounds to the
    dtype, then the product does. (The decode GEMVs make the down projection's input with it.)"""
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr, out_ptr, q_ptr, scale_ptr, static_ptr, K,
    BLOCK: tl.constexpr, QUANT: tl.constexpr, HAS_STATIC: tl.constexpr, CLIP: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, column block); quantizing, one block holds the whole row (its absmax)."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    dtype = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * 2 * K + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * 2 * K + K + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul(g, up, dtype)
    if QUANT:
        _quantize_row(y.to(tl.float32), cols, mask, q_ptr, scale_ptr, static_ptr, row, K, HAS_STATIC, CLIP)
    else:
        tl.store(out_ptr + row * K + cols, y, mask=mask)


@triton.jit
def _silu_and_mul_quant_rows_kernel(
    gu_ptr, y_ptr, q_ptr, scale_ptr, static_ptr, K,
    BLOCK: tl.constexpr, HAS_STATIC: tl.constexpr, CLIP: tl.constexpr, RECOMPUTE: tl.constexpr, PDL: tl.constexpr,
):
    """Quantizing SiLU·mul of one row in column chunks: each chunk's SiLU·mul (in the model dtype)
    goes to y_ptr as the row's absmax grows, then comes back to be quantized; or (RECOMPUTE) the
    first pass keeps only the absmax and the second reads gate and up again (their row, 44 KB at
    7B, just read: from L2) and makes the same values, so y never goes to memory. The one-block
    kernel holds a prefill row of 11,008 in 16 warps at 88 registers, one program an SM; this one
    8 warps at 40. On an H200 at 2,048 x 11,008: 54.4 µs against 58.6 and the plain SiLU·mul's 33.5
    (2026-11-30): ~22 µs more, what y's 45 MB out and back take from DRAM. RECOMPUTE: not yet timed."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = gu_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < K
        g = tl.load(gu_ptr + row * 2 * K + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * 2 * K + K + cols, mask=mask, other=0.0).to(tl.float32)
        y = silu_mul(g, up, dtype)
        if not RECOMPUTE:
            tl.store(y_ptr + row * K + cols, y, mask=mask)
        amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))  # (masked columns are SiLU(0) * 0 = 0)
    scale = _row_scale(tl.max(amax, axis=0), static_ptr, HAS_STATIC, CLIP)
    if not RECOMPUTE:
        tl.debug_barrier()  # (every thread's stores of y before any thread reads them back)
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < K
        if RECOMPUTE:
            g = tl.load(gu_ptr + row * 2 * K + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gu_ptr + row * 2 * K + K + cols, mask=mask, other=0.0).to(tl.float32)
            y = silu_mul(g, up, dtype)
        else:
            y = tl.load(y_ptr + row * K + cols, mask=mask, other=0.0)
        _store_quantized(y.to(tl.float32), scale, cols, mask, q_ptr, row, K)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, K, BLOCK: tl.constexpr, HAS_STATIC: tl.constexpr, CLIP: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    _quantize_row(x, cols, mask, q_ptr, scale_ptr, static_ptr, row, K, HAS_STATIC, CLIP)


SILU_BLOCK = 2048  # columns a SiLU·mul program takes (without quantization)
# quantizing, batches of SILU_QUANT_ROWS rows or more take the chunked kernel, SILU_QUANT_BLOCK columns a chunk;
# SILU_QUANT_RECOMPUTE: its second pass makes SiLU·mul again rather than reading it back (tune_silu_quant times both)
SILU_QUANT_ROWS, SILU_QUANT_BLOCK, SILU_QUANT_RECOMPUTE = 128, 2048, False
_SILU_TUNED: dict[tuple, dict[str, float]] = {}  # tune_silu_quant's timings


def _launch_config(k: int) -> tuple[int, int]:
    block = next_power_of_2(k)
    return block, max(1, min(16, block // 512))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _norm(x, residual, weight, eps, quant: bool, static_scale=None, clip=False):
    shape, K = x.shape, x.shape[-1]
    x2 = _rows(x)
    M = x2.shape[0]
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else x2
    out = x2 if quant else torch.empty_like(x2)
    q = torch.empty(M, K, dtype=torch.int8, device=x.device) if quant else out
    scale = torch.empty(M, dtype=torch.float32, device=x.device) if quant else out
    static = static_scale if static_scale is not None else scale
    block, warps = _launch_config(K)
    if M:
        _rms_norm_kernel[(M,)](
            x2, res2, weight, out, res_out, q, scale, static, K, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, QUANT=quant, HAS_STATIC=static_scale is not None, CLIP=clip, num_warps=warps,
            **pdl.launch_args(x2),
        )
    res_out = res_out.view(shape)
    if quant:
        result = (q.view(shape), scale.view(shape[:-1]))
    else:
        result = out.view(shape)
    return result if residual is None else (result, res_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps, quant=False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps, quant=False)


def rms_norm_quant(x, weight, eps, static_scale=None, clip=False):
    return _norm(x, None, weight, eps, True, static_scale, clip)


def add_rms_norm_quant(x, residual, weight, eps, static_scale=None, clip=False):
    return _norm(x, residual, weight, eps, True, static_scale, clip)


def _silu(gate_up: torch.Tensor, quant: bool, static_scale=None, clip=False):
    K = gate_up.shape[-1] // 2
    shape = (*gate_up.shape[:-1], K)
    gu = _rows(gate_up)
    M = gu.shape[0]
    out = torch.empty(M, K, dtype=gate_up.dtype, device=gate_up.device)
    q = torch.empty(M, K, dtype=torch.int8, device=gate_up.device) if quant else out
    scale = torch.empty(M, dtype=torch.float32, device=gate_up.device) if quant else out
    if quant and M >= SILU_QUANT_ROWS:
        _silu_and_mul_quant_rows_kernel[(M,)](
            gu, out, q, scale, static_scale if static_scale is not None else scale, K,
            BLOCK=SILU_QUANT_BLOCK, HAS_STATIC=static_scale is not None, CLIP=clip, RECOMPUTE=SILU_QUANT_RECOMPUTE,
            num_warps=max(1, min(8, SILU_QUANT_BLOCK // 256)),
            **pdl.launch_args(gu),
        )
        return q.view(shape), scale.view(shape[:-1])
    # without quantization, columns split over programs: a decode row of 11,008 in one program
    # took 4 us on an H200 (a 7B step runs 32)
    block, warps = _launch_config(K) if quant else _launch_config(min(K, SILU_BLOCK))
    if M:
        _silu_and_mul_kernel[(M, cdiv(K, block))](
            gu, out, q, scale, static_scale if static_scale is not None else scale, K,
            BLOCK=block, QUANT=quant, HAS_STATIC=static_scale is not None, CLIP=clip, num_warps=warps, **pdl.launch_args(gu),
        )
    return (q.view(shape), scale.view(shape[:-1])) if quant else out.view(shape)


def tune_silu_quant(K: int, dtype: torch.dtype, device: torch.device, rows: int = 2048) -> dict[tuple, dict[str, float]]:
    """Time the chunked quantizing SiLU·mul's second pass both ways on this device at `rows` x K
    (a W8A8 prefill's), and make SiLU·mul again from then on where that is 3% faster or more (the
    same output either way). Returns {("w8a8 silu quant", K, rows): {way: ms}}."""
    global SILU_QUANT_RECOMPUTE
    from .gemv import _time

    key = ("w8a8 silu quant", K, rows)
    if key not in _SILU_TUNED:  # (once a shape: every engine over the model prepares it again)
        gu = torch.randn(rows, 2 * K, dtype=dtype, device=device)
        ms = {}
        for recompute in (False, True):
            SILU_QUANT_RECOMPUTE = recompute
            ms[recompute] = _time(lambda: silu_and_mul_quant(gu)[0])
        _SILU_TUNED[key] = {"read back": ms[False], "made again": ms[True]}
    ms = _SILU_TUNED[key]
    SILU_QUANT_RECOMPUTE = ms["made again"] < 0.97 * ms["read back"]
    return {key: ms}


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _silu(gate_up, False)


def silu_and_mul_quant(gate_up, static_scale=None, clip=False):
    return _silu(gate_up, True, static_scale, clip)


def quantize_per_token(x: torch.Tensor, static_scale=None, clip=False) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnQuantizedTranspose and every other float input of a W8A8 linear: int8 rows + scales."""
    shape, K = x.shape, x.shape[-1]
    x2 = _rows(x)
    M = x2.shape[0]
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    block, warps = _launch_config(K)
    if M:
        _quantize_kernel[(M,)](x2, q, scale, static_scale if static_scale is not None else scale, K,
                               BLOCK=block, HAS_STATIC=static_scale is not None, CLIP=clip, num_warps=warps, **pdl.launch_args(x2))
    return q.view(shape), scale.view(shape[:-1])


OPS = {
    "quantize_per_token": quantize_per_token,
    "rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rms_norm_quant": rms_norm_quant, "add_rms_norm_quant": add_rms_norm_quant,
    "silu_and_mul": silu_and_mul, "silu_and_mul_quant": silu_and_mul_quant,
}
