"""Quantize / dequantize tensors: symmetric int8 per output channel or per group, and 4-bit
group-wise (asymmetric, like GGUF Q4_1, with searched scales and mins)."""

from __future__ import annotations

import torch

from .. import ops


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: scale = absmax/127 per output row (group_size None) or per group of
    `group_size` input columns. Returns (int8 [N, K], fp32 scales [N] or [N, K/group]). Group
    scales are fp16 values, as Q8_0 stores them (subnormal ones too: the values are then rounded
    with the stored scale; a group under ~4e-6 is all 0): the GPU keeps them in fp16, 8.5 bits a
    weight instead of 9 (backends/cuda.compact_scales)."""
    w = w.float()
    N, K = w.shape
    g = w.view(N, 1, K) if group_size is None else w.view(N, K // group_size, group_size)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / 127
    div = scale
    if group_size is not None and bool(scale.max() <= 65504):
        scale = scale.half().float()  # (rounded down, it puts absmax at 127 + 2^-11 at most: rounded to 127)
        div = torch.where(scale > 0, scale, 1.0)
    q = (g / div[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(N, K)  # (one float temporary at a time:
    # a vocabulary matrix is 100+ MB)
    return q, (scale.view(N) if group_size is None else scale)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, mins: torch.Tensor | None = None) -> torch.Tensor:
    """q * scale (+ min) per channel [N] or per group [N, G] (mins: per group only)."""
    N, K = q.shape
    if scale.dim() == 1:
        return (q.to(dtype) * scale.to(dtype)[:, None])
    groups = scale.shape[1]
    w = q.view(N, groups, K // groups).to(dtype) * scale.to(dtype)[..., None]
    return (w if mins is None else w + mins.to(dtype)[..., None]).view(N, K)


def chunk_groups(device: torch.device) -> int:
    """Groups one vectorized step of the scale search takes. Few on the CPU, where the temporaries
    then stay in cache (4,096 groups: 1.6x faster than 65,536); many elsewhere, since each step is
    ~500 kernel launches (a 7B model's 200M groups 4,096 at a time took minutes on an H200)."""
    return 4096 if device.type == "cpu" else 1 << 20


def search_scale_min(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float = -1.0, rdelta: float = 0.1, nstep: int = 20,
                     use_mad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, min, levels) per group (rows of x [n, g]) for x ~ scale * L + min, L in [0, nmax]:
    llama.cpp's make_qkx2_quants, shared by w4 and the K-quant writer (kquants; Q4_K's settings are
    the defaults). A backend's kernel where it has one (the CPU's C kernel, ~20x the torch steps),
    else search_scale_min_torch on x's device."""
    backend = ops.registered("search_scale_min", x.device)
    if backend is not None:
        return backend(x, weights, nmax, rmin, rdelta, nstep, use_mad)
    return search_scale_min_torch(x, weights, nmax, rmin, rdelta, nstep, use_mad)


def search_scale_min_torch(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float = -1.0, rdelta: float = 0.1, nstep: int = 20,
                           use_mad: bool = False, groups_per_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """search_scale_min in torch (the reference of the backends' kernels): start from the min..max
    grid; for each of nstep + 1 candidate inverse scales (nmax + rmin + rdelta i) / (max - min)
    round the group, refit scale and min by weighted least squares and keep the least weighted error
    (squared, or absolute with use_mad). The min never goes above 0 (a positive group keeps 0
    representable). A 7B model's groups take seconds on a GPU. Groups go groups_per_chunk at a
    time (default: chunk_groups)."""
    groups_per_chunk = groups_per_chunk or chunk_groups(x.device)
    parts = [_search_chunk(x[lo : lo + groups_per_chunk], weights[lo : lo + groups_per_chunk], nmax, rmin, rdelta, nstep, use_mad)
             for lo in range(0, x.shape[0], groups_per_chunk)]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(t) for t in zip(*parts))  # type: ignore[return-value]


def _search_chunk(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                  use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xmin = x.amin(dim=1).clamp(max=0)
    rng = x.amax(dim=1) - xmin
    live = rng > 0
    inv_rng = torch.where(live, 1 / torch.where(live, rng, 1.0), 0.0)
    shifted = x - xmin[:, None]
    sum_w, sum_x, sum_x2 = weights.sum(1), (weights * x).sum(1), (weights * x * x).sum(1)

    def levels_at(factor: torch.Tensor | float) -> torch.Tensor:
        return torch.round((factor if isinstance(factor, float) else factor[:, None]) * inv_rng[:, None] * shifted).clamp_(0, nmax)

    def level_sums(levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wl = weights * levels
        return wl.sum(1), (wl * levels).sum(1), (wl * x).sum(1)

    def err(scale: torch.Tensor, mn: torch.Tensor, levels: torch.Tensor, sums: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The weighted error of x ~ scale * levels + min. Squared errors come from the sums
        (sum w (s l + m - x)^2 expanded): no pass over the groups."""
        if use_mad:
            return (weights * (scale[:, None] * levels + mn[:, None] - x).abs()).sum(1)
        sum_l, sum_l2, sum_xl = sums
        return (scale * (scale * sum_l2 + 2 * (mn * sum_l - sum_xl)) + mn * (mn * sum_w - 2 * sum_x) + sum_x2).clamp_(min=0)

    scale = torch.where(live, rng / nmax, 0.0)
    mn = xmin.clone()
    factor = torch.full_like(scale, float(nmax))
    first = levels_at(float(nmax))
    best = err(scale, mn, first, level_sums(first))
    for step in range(nstep + 1):
        c = nmax + rmin + rdelta * step
        cand = levels_at(c)
        sum_l, sum_l2, sum_xl = sums = level_sums(cand)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, 1.0)
        c_scale, c_min = (sum_w * sum_xl - sum_x * sum_l) / safe, (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = c_min > 0  # the min may only go down: refit the scale through zero
        c_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0), c_scale)
        c_min = torch.where(positive, 0.0, c_min)
        c_err = err(c_scale, c_min, cand, sums)
        take = live & ok & (c_err < best)
        best, scale, mn = torch.where(take, c_err, best), torch.where(take, c_scale, scale), torch.where(take, c_min, mn)
        factor = torch.where(take, c, factor)
    return scale, mn, levels_at(factor)  # the winning candidate's levels, rounded as they were


def quantize_int4(w: torch.Tensor, group_size: int, importance: torch.Tensor | None = None,
                  rows_per_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group (like GGUF Q4_1): w ~ scale * q + min, q in 0..15, with the
    scale and min of each group searched as llama.cpp's Q4_K quantizer does (search_scale_min;
    the error weighted by sqrt(2 mean(w^2) + w^2), times `importance` [K] of each input column when
    given, e.g. the mean x^2 of the activations that meet it: an importance matrix), then rounded
    to fp16 as stored, the values rounded again to them.
    Returns (q int32 [N, K], scale [N, K/g], min [N, K/g]) on w's device."""
    N, K = w.shape
    per_row = K // group_size
    x = w.detach().float().reshape(-1, group_size)
    col = None
    if importance is not None:
        col = importance.detach().float().to(x.device).clamp(min=0)
        col = (col / col.mean().clamp(min=1e-30)).reshape(per_row, group_size)
    scale, mins = torch.empty(x.shape[0], device=x.device), torch.empty(x.shape[0], device=x.device)
    rows_per_chunk = rows_per_chunk or max(1 << 16, chunk_groups(x.device))
    step = max(1, rows_per_chunk // per_row) * per_row  # whole rows: the column weights repeat per row
    for lo in range(0, x.shape[0], step):
        g = x[lo : lo + step]
        wt = torch.sqrt(2 * (g * g).mean(1, keepdim=True) + g * g)
        if col is not None:
            wt = wt * col.repeat(g.shape[0] // per_row, 1)
        scale[lo : lo + step], mins[lo : lo + step], _ = search_scale_min(g, wt, 15)
    s16, m16 = scale.half().float(), mins.half().float()
    live = s16 > 0
    q = torch.round((x - m16[:, None]) / torch.where(live, s16, 1.0)[:, None]).clamp_(0, 15)
    q = torch.where(live[:, None], q, 0.0).to(torch.int32).view(N, K)
    return q, s16.view(N, -1), m16.view(N, -1)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    N, K = q.shape
    groups = scale.shape[1]
    g = q.view(N, groups, K // groups).to(dtype) * scale.to(dtype)[..., None] + mins.to(dtype)[..., None]
    return g.view(N, K)


def quantize_q4_0(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit per group, as GGUF's Q4_0 (llama.cpp's quantize_row_q4_0_ref, value for
    value): the group's value of largest magnitude m maps to level 0, d = m / -8, q = min(15,
    trunc(x / d + 8.5)), the scale d stored in fp16; w ~ scale * (q - 8). Returns (q int32 [N, K],
    scale [N, K/g], min = -8 * scale [N, K/g]): an Int4Linear's arguments (the CUDA backend then
    drops the mins: backends/cuda.compact_scales)."""
    N, K = w.shape
    x = w.detach().float().reshape(-1, group_size)
    d = x.gather(1, x.abs().argmax(1, keepdim=True)) / -8
    inv = torch.where(d != 0, 1 / d, 0.0)
    q = torch.trunc(x * inv + 8.5).clamp_(0, 15).to(torch.int32).view(N, K)
    s16 = d.half().float().view(N, -1)
    return q, s16, -8 * s16


def pick_group_size(k: int, preferred: int) -> int | None:
    """The largest of preferred, 128, 64, 32 (not above preferred) that divides k, or None."""
    for g in (preferred, 128, 64, 32):
        if g <= preferred and k % g == 0:
            return g
    return None
