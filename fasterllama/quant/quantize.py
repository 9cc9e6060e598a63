"""Quantize / dequantize tensors: symmetric int8 per output channel or per group, and 4-bit
group-wise (asymmetric, like GGUF Q4_1; symmetric Q4_0 is the zero = 8*scale case)."""

from __future__ import annotations

import torch


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: scale = absmax/127 per output row (group_size None) or per group of
    `group_size` input columns. Returns (int8 [N, K], fp32 scales [N] or [N, K/group])."""
    w = w.float()
    N, K = w.shape
    g = w.view(N, 1, K) if group_size is None else w.view(N, K // group_size, group_size)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / 127  # (one float temporary at a time: a vocabulary
    q = (g / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(N, K)  # matrix is 100+ MB)
    return q, (scale.view(N) if group_size is None else scale)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    N, K = q.shape
    if scale.dim() == 1:
        return (q.to(dtype) * scale.to(dtype)[:, None])
    groups = scale.shape[1]
    return (q.view(N, groups, K // groups).to(dtype) * scale.to(dtype)[..., None]).view(N, K)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group (like GGUF Q4_1): w ~ scale * q + min, q in 0..15.
    Returns (q int32 [N, K], scale [N, K/g], min [N, K/g])."""
    w = w.float()
    N, K = w.shape
    g = w.view(N, K // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
    return q, scale, lo


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    N, K = q.shape
    groups = scale.shape[1]
    g = q.view(N, groups, K // groups).to(dtype) * scale.to(dtype)[..., None] + mins.to(dtype)[..., None]
    return g.view(N, K)


def pick_group_size(k: int, preferred: int) -> int | None:
    """The largest of preferred, 128, 64, 32 (not above preferred) that divides k, or None."""
    for g in (preferred, 128, 64, 32):
        if g <= preferred and k % g == 0:
            return g
    return None
