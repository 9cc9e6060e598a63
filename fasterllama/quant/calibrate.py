"""Calibration for static activation scales (FasterTransformer v3.0): run the float model over a
calibration text, record what enters each int8 GEMM, and pick a clipping threshold per tensor
with max, percentile, MSE-minimizing or entropy (KL) calibration. Also SmoothQuant smoothing."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

from ..errors import FasterLlamaError
from ..tokenizer import Tokenizer

SAMPLES_PER_BATCH = 1 << 15
HIST_BINS = 2048
CALIBRATION_FILE = os.path.join(os.path.dirname(__file__), "calibration.txt")  # mixed English prose, dialogue and code


def calibration_chunks(tokenizer: Tokenizer, text: str | None, max_tokens: int, chunk: int) -> list[list[int]]:
    """The calibration prompts: the text's first max_tokens tokens (the shipped sample's by
    default) in chunks of `chunk`."""
    if text is None:
        with open(CALIBRATION_FILE, encoding="utf-8") as fh:
            text = fh.read()
    ids = tokenizer.encode(text)[:max_tokens]
    if len(ids) < 16:
        raise FasterLlamaError("the calibration text is too short (need at least 16 tokens)")
    return [ids[i : i + chunk] for i in range(0, len(ids), chunk)]


class ActivationStats:
    """Absmax (global and per input channel), mean x^2 per channel and a random sample of |x|
    entering one linear."""

    def __init__(self, in_features: int) -> None:
        self.amax = 0.0
        self.channel_amax = torch.zeros(in_features)
        self.channel_sq = torch.zeros(in_features, dtype=torch.float64)  # sum of x^2 per input channel
        self.rows = 0
        self.samples: list[torch.Tensor] = []
        self._gen = torch.Generator().manual_seed(0)

    def add(self, x: torch.Tensor) -> None:
        a = x.detach().float().abs().reshape(-1, x.shape[-1]).cpu()
        self.amax = max(self.amax, float(a.max()))
        self.channel_amax = torch.maximum(self.channel_amax, a.amax(dim=0))
        self.channel_sq += (a.double() ** 2).sum(dim=0)
        self.rows += a.shape[0]
        flat = a.reshape(-1)
        if flat.numel() > SAMPLES_PER_BATCH:
            flat = flat[torch.randint(flat.numel(), (SAMPLES_PER_BATCH,), generator=self._gen)]
        self.samples.append(flat.clone())

    @property
    def importance(self) -> torch.Tensor:
        """Mean x^2 per input channel: how much an error in each weight column costs (llama.cpp's
        importance matrix)."""
        return (self.channel_sq / max(self.rows, 1)).float()

    def values(self) -> np.ndarray:
        return torch.cat(self.samples).numpy().astype(np.float64)


def collect_stats(
    model: nn.Module, run: Callable[[list[int]], object], chunks: Iterable[list[int]], targets: dict[str, nn.Module], skip_sinks: bool = False
) -> dict[str, ActivationStats]:
    """Run `run(chunk)` for every token chunk with hooks recording the inputs of `targets`
    (without the rows of sequence-start tokens if `skip_sinks`)."""
    from .. import ops

    def record(stats: ActivationStats, x: torch.Tensor) -> None:
        meta = ops.current_step() if skip_sinks else None
        if meta is not None and meta.first_token_rows.numel():
            keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
            keep[meta.first_token_rows] = False
            x = x[keep]
        if x.shape[0]:
            stats.add(x)

    stats: dict[str, ActivationStats] = {}
    handles = []
    for name, module in targets.items():
        stats[name] = ActivationStats(module.in_features)
        handles.append(module.register_forward_pre_hook(lambda m, args, _s=stats[name]: record(_s, args[0])))
    try:
        for chunk in chunks:
            run(chunk)
    finally:
        for h in handles:
            h.remove()
    return stats


def _fake_quant_mse(v: np.ndarray, clip: float) -> float:
    s = clip / 127
    q = np.clip(np.round(v / s), -127, 127) * s
    return float(np.mean((v - q) ** 2))


def threshold(stats: ActivationStats, method: str, percentile: float = 99.99) -> float:
    """The |x| clipping threshold for int8 (scale = threshold / 127)."""
    if stats.amax == 0:
        return 1e-6
    if method == "max":
        return stats.amax
    v = stats.values()
    if method == "percentile":
        return max(float(np.percentile(v, percentile)), 1e-6)
    if method == "mse":
        candidates = stats.amax * np.linspace(0.02, 1.0, 100)
        errors = [_fake_quant_mse(v, c) for c in candidates]
        return float(candidates[int(np.argmin(errors))])
    if method == "entropy":
        return _kl_threshold(v, stats.amax)
    raise ValueError(method)


def _kl_threshold(v: np.ndarray, amax: float, levels: int = 128) -> float:
    """TensorRT's entropy calibration: the threshold whose 128-level quantized histogram has the
    smallest KL divergence from the clipped reference histogram."""
    hist, edges = np.histogram(v, bins=HIST_BINS, range=(0, amax))
    hist = hist.astype(np.float64)
    best, best_kl = HIST_BINS, np.inf
    for i in range(levels, HIST_BINS + 1, 16):
        ref = hist[:i].copy()
        ref[-1] += hist[i:].sum()  # clipped outliers land in the last bin
        # quantize the first i bins into `levels` bins, then expand back over the non-empty bins
        chunks = np.array_split(hist[:i], levels)
        q = np.concatenate([np.where(c > 0, c.sum() / max((c > 0).sum(), 1), 0.0) for c in chunks])
        p = ref / ref.sum()
        qn = q / max(q.sum(), 1e-12)
        mask = p > 0
        kl = np.sum(p[mask] * np.log(p[mask] / np.maximum(qn[mask], 1e-12)))
        if kl < best_kl:
            best, best_kl = i, kl
    return float(edges[best] if best < len(edges) else amax)


def smoothing_factors_from_amax(act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-channel s_j = amax_x^a / amax_w^(1-a): x/s is easier to quantize, W*s harder."""
    act_amax = act_amax.to(weight_amax.device)  # statistics live on the CPU, weights maybe on the GPU
    s = act_amax.float().clamp(min=1e-5) ** alpha / weight_amax.float().clamp(min=1e-5) ** (1 - alpha)
    return s.clamp(min=1e-5)


def smoothing_factors(act_amax: torch.Tensor, linear_weight: torch.Tensor, alpha: float) -> torch.Tensor:
    return smoothing_factors_from_amax(act_amax, linear_weight.abs().amax(dim=0), alpha)


def smooth(norm_weight: torch.Tensor, linear_weight: torch.Tensor, act_channel_amax: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SmoothQuant folded into a preceding RMSNorm: returns the new (norm weight, linear weight)."""
    s = smoothing_factors(act_channel_amax, linear_weight, alpha)
    return norm_weight / s.to(norm_weight.dtype), linear_weight * s.to(linear_weight.dtype)[None, :]
