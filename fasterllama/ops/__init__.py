"""The op layer: every op the model calls, dispatched by device type.

Each op has a PyTorch reference (`reference.py`) that runs on any device. A faster backend
registers its version for a device type with `register`; tests compare it with the reference."""

from __future__ import annotations

from typing import Callable

import torch

from . import reference

_BACKENDS: dict[str, dict[str, Callable]] = {}


def register(device_type: str, name: str, fn: Callable) -> None:
    """Use `fn` for op `name` on tensors of `device_type` ("cpu", "cuda")."""
    _BACKENDS.setdefault(device_type, {})[name] = fn


def get_op(name: str, device: torch.device | str) -> Callable:
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return _BACKENDS.get(device_type, {}).get(name) or getattr(reference, name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return get_op("rms_norm", x.device)(x, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return get_op("apply_rope", x.device)(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return get_op("silu_and_mul", gate_up.device)(gate_up)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return get_op("linear", x.device)(x, weight, bias)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: "reference.AttentionMetadata") -> None:
    get_op("store_kv", k.device)(k_cache, v_cache, k, v, meta)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: "reference.AttentionMetadata", scale: float) -> torch.Tensor:
    return get_op("attention", q.device)(q, k_cache, v_cache, meta, scale)


AttentionMetadata = reference.AttentionMetadata
