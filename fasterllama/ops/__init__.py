"""The op layer: every op the model calls, dispatched by device type.

Each op has a PyTorch reference (`reference.py`) that runs on any device. A faster backend
registers its version for a device type with `register`; tests compare it with the reference."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from . import quantized, reference
from .metadata import AttentionMetadata, block_tables_tensor  # noqa: F401  (ops.block_tables_tensor)

_BACKENDS: dict[str, dict[str, Callable]] = {}


def register(device_type: str, name: str, fn: Callable) -> None:
    """Use `fn` for op `name` on tensors of `device_type` ("cpu", "cuda")."""
    _BACKENDS.setdefault(device_type, {})[name] = fn


_step: ContextVar[AttentionMetadata | None] = ContextVar("fasterllama_step", default=None)


@contextmanager
def step(meta: AttentionMetadata) -> Iterator[None]:
    """Make the running forward's metadata visible to code whose call signature does not carry it
    (calibration hooks leave the rows that start a sequence out of static int8 statistics)."""
    token = _step.set(meta)
    try:
        yield
    finally:
        _step.reset(token)


def current_step() -> AttentionMetadata | None:
    return _step.get()


def registered(name: str, device: torch.device | str) -> Callable | None:
    """A backend's own version of `name` for this device, None if it has none (for ops whose
    reference lives with their caller: the sampler's `sample_rows`)."""
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return _BACKENDS.get(device_type, {}).get(name)


def get_op(name: str, device: torch.device | str) -> Callable:
    return registered(name, device) or getattr(reference, name, None) or getattr(quantized, name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return get_op("rms_norm", x.device)(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return get_op("add_rms_norm", x.device)(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return get_op("silu_and_mul", gate_up.device)(gate_up)


def silu_and_mul_linear(gate_up: torch.Tensor, down: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """down(SiLU(gate) * up), the MLP's second half: a backend may make SiLU·mul inside down's
    kernel (its version returns None where it does not, and the two ops run)."""
    fused = registered("silu_and_mul_linear", gate_up.device)
    out = fused(gate_up, down) if fused is not None else None
    return out if out is not None else down(silu_and_mul(gate_up))


def rms_norm_linear(h: torch.Tensor, residual: torch.Tensor | None, norm: Callable, linear: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(h + residual)), h + residual), residual None: (linear(norm(h)), h). The norm
    before each of a layer's first linears: a backend may make the norm inside the linear's kernel
    (its version returns None where it does not, and the two modules run)."""
    fused = registered("rms_norm_linear", h.device)
    out = fused(h, residual, norm, linear) if fused is not None else None
    if out is not None:
        return out
    if residual is None:
        return linear(norm(h)), h
    x, residual = norm(h, residual)
    return linear(x), residual


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return get_op("linear", x.device)(x, weight, bias)


def argmax(x: torch.Tensor) -> torch.Tensor:
    return get_op("argmax", x.device)(x)


def argmax_tokens(x: torch.Tensor) -> list[int]:
    return get_op("argmax_tokens", x.device)(x)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return get_op("rope_tables", positions.device)(positions, inv_freq)


def rope_and_store_kv(qkv, cos, sin, kv, meta, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    return get_op("rope_and_store_kv", qkv.device)(qkv, cos, sin, kv[0], kv[1], meta, num_heads, num_kv_heads, head_dim)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return get_op("attention", q.device)(q, k_cache, v_cache, meta, scale)


def rope_store_attention(qkv, cos, sin, kv, meta, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """rope_and_store_kv, then attention: one op, so that a backend may do both in one kernel (the
    CUDA backend's decode steps)."""
    fused = registered("rope_store_attention", qkv.device)
    if fused is not None:
        return fused(qkv, cos, sin, kv[0], kv[1], meta, num_heads, num_kv_heads, head_dim, scale)
    return attention(rope_and_store_kv(qkv, cos, sin, kv, meta, num_heads, num_kv_heads, head_dim), kv[0], kv[1], meta, scale)


# -- quantized ops (see quantized.py) -----------------------------------------------------------
def int8_weight_linear(x, qweight, scale, bias=None, mins=None):
    return get_op("int8_weight_linear", x.device)(x, qweight, scale, bias, mins)


def int4_weight_linear(x, packed, scales, mins, group_size, bias=None, sups=None):
    """sups: (scale_super, min_super) where scales and mins are a K-quant's int8 sub-block values."""
    return get_op("int4_weight_linear", x.device)(x, packed, scales, mins, group_size, bias, sups=sups)


def int8_weight_linear_a8(x, qweight, scale, bias=None, mins=None):
    return get_op("int8_weight_linear_a8", x.device)(x, qweight, scale, bias, mins)


def int4_weight_linear_a8(x, packed, scales, mins, group_size, bias=None, sups=None):
    return get_op("int4_weight_linear_a8", x.device)(x, packed, scales, mins, group_size, bias, sups=sups)


def panel_linear(x, qp, sp, mp, n, bits, bias=None, sups=None):
    return get_op("panel_linear", x.device)(x, qp, sp, mp, n, bits, bias, sups)


def panel_linear_a8(x, qp, sp, mp, n, bits, bias=None, sups=None):
    return get_op("panel_linear_a8", x.device)(x, qp, sp, mp, n, bits, bias, sups)


def quantize_per_token(x, static_scale=None, clip=False):
    return get_op("quantize_per_token", x.device)(x, static_scale, clip)


def int8_gemm(xq, qweight_t):
    return get_op("int8_gemm", xq.device)(xq, qweight_t)


def int8_linear(xq, x_scale, qweight, w_scale, bias, dtype):
    """W8A8: int8 rows x int8 weights [N, K], exact int32 sums, dequantized per token x channel."""
    return get_op("int8_linear", xq.device)(xq, x_scale, qweight, w_scale, bias, dtype)


def dequantize_gemm(acc, x_scale, w_scale, bias, dtype):
    return get_op("dequantize_gemm", acc.device)(acc, x_scale, w_scale, bias, dtype)


def rms_norm_quant(x, weight, eps, static_scale=None, clip=False):
    return get_op("rms_norm_quant", x.device)(x, weight, eps, static_scale, clip)


def add_rms_norm_quant(x, residual, weight, eps, static_scale=None, clip=False):
    return get_op("add_rms_norm_quant", x.device)(x, residual, weight, eps, static_scale, clip)


def silu_and_mul_quant(gate_up, static_scale=None, clip=False):
    return get_op("silu_and_mul_quant", gate_up.device)(gate_up, static_scale, clip)


pack_int4 = quantized.pack_int4
unpack_int4_rows = quantized.unpack_int4_rows
to_panels, from_panels, panel_rows = quantized.to_panels, quantized.from_panels, quantized.panel_rows
int8_to_panels, int8_panel_rows = quantized.int8_to_panels, quantized.int8_panel_rows
pack_panels = quantized.pack_panels


def dequantize_panel_rows(qp, sp, mp, bits, rows, n, dtype=torch.float32, sups=None):
    return get_op("dequantize_panel_rows", qp.device)(qp, sp, mp, bits, rows, n, dtype, sups)
