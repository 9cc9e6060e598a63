"""Turn a loaded float model into a quantized one, module by module (same call signatures)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import ops
from ..model.llama import Linear, LlamaForCausalLM, RMSNorm
from . import calibrate
from .config import QuantConfig
from .linear import Int4Linear, Int8Linear, QuantizedEmbedding, W8A8Linear
from .quantize import pick_group_size, quantize_int4, quantize_int8, quantize_q4_0

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class QuantRMSNorm(nn.Module):
    """RMSNorm fused with per-token int8 quantization (FasterLLaMA's resNormQuantized)."""

    def __init__(self, norm: RMSNorm, static_scale: torch.Tensor | None, clip: bool = False) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        self.static_scale = None if static_scale is None else nn.Parameter(static_scale, requires_grad=False)
        self.clip = clip

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(int8 rows, scales); given the residual stream, ((int8 rows, scales), new residual)."""
        if residual is None:
            return ops.rms_norm_quant(x, self.weight, self.eps, self.static_scale, self.clip)
        return ops.add_rms_norm_quant(x, residual, self.weight, self.eps, self.static_scale, self.clip)


class SiluAndMulQuant(nn.Module):
    """SiLU(gate)*up fused with per-token int8 quantization for the int8 down projection."""

    def __init__(self, static_scale: torch.Tensor | None, clip: bool = False) -> None:
        super().__init__()
        self.static_scale = None if static_scale is None else nn.Parameter(static_scale, requires_grad=False)
        self.clip = clip

    def forward(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.silu_and_mul_quant(gate_up, self.static_scale, self.clip)


def quantize_linear(lin: nn.Module, cfg: QuantConfig, input_scale: torch.Tensor | None = None, importance: torch.Tensor | None = None) -> nn.Module:
    w, b = lin.weight.data.float(), None if lin.bias is None else lin.bias.data
    if cfg.mode == "w8a8":
        q, s = quantize_int8(w)
        return W8A8Linear(q, s, input_scale, b, dtype=lin.weight.dtype, clip=cfg.clip)
    group = pick_group_size(w.shape[1], cfg.group_size) if cfg.group_size else None
    if cfg.mode == "w8" or group is None:  # (w4 falls back to int8 per channel where no group fits)
        q, s = quantize_int8(w, group)
        return Int8Linear(q, s, b)
    q, s, z = quantize_q4_0(w, group) if cfg.symmetric else quantize_int4(w, group, importance)
    return Int4Linear(q, s, z, b)


def quantize_model(
    model: LlamaForCausalLM,
    cfg: QuantConfig,
    run: Callable[[list[int]], object] | None = None,
    calibration_chunks: list[list[int]] | None = None,
    placeholders: bool = False,
    progress: bool = False,
) -> None:
    """Quantize in place. `run(token_ids)` runs the float model (for calibration and smoothing).
    placeholders: only build the quantized structure (static scales = 1), to load saved tensors into.
    progress: bars on stderr for the calibration passes and the layers (the calibration passes and
    w4's scale search take seconds for the default model, and grow with the model)."""

    def bar(items: Iterable[Any], desc: str, unit: str) -> Iterable[Any]:
        if not progress:
            return items
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit=unit, file=sys.stderr, leave=False)

    def activation_stats(skip_sinks: bool) -> dict[str, calibrate.ActivationStats]:
        """One calibration pass over the chunks, recording what enters every layer's linears."""
        targets = {f"{i}.{n}": layer.get_submodule(n) for i, layer in enumerate(layers) for n in LINEARS}
        return calibrate.collect_stats(model, run, bar(calibration_chunks, "Calibrating", "chunk"), targets, skip_sinks)

    smooth_alpha = None if placeholders else cfg.smoothquant_alpha  # saved weights are smoothed already
    calibrate_static = cfg.static_activations and not placeholders
    if (smooth_alpha is not None or calibrate_static) and (run is None or not calibration_chunks):
        raise ValueError("static activation scales and SmoothQuant need calibration tokens")
    layers = list(model.layers)
    # Static scales leave sequence-start tokens (attention sinks, ~100x the rest) out of the
    # statistics: beyond any static range, they take their own scales at run time (unless -clip).
    skip_sinks = cfg.static_activations and not cfg.clip
    if smooth_alpha is not None:
        stats = activation_stats(skip_sinks)
        for i, layer in enumerate(layers):
            smooth_layer(layer, model.config, {n: stats[f"{i}.{n}"].channel_amax for n in LINEARS}, smooth_alpha)
    importance: dict[str, torch.Tensor] = {}
    if cfg.imatrix and not placeholders:
        if run is None or not calibration_chunks:
            raise ValueError("w4's importance matrix needs calibration tokens")
        importance = {k: s.importance for k, s in activation_stats(False).items()}
    scales: dict[str, torch.Tensor] = {}
    device = model.embed_tokens.weight.device  # the statistics are gathered on the CPU
    if calibrate_static:
        stats = activation_stats(skip_sinks)
        scales = {k: torch.tensor(calibrate.threshold(s, cfg.calibrator, cfg.percentile) / 127, device=device) for k, s in stats.items()}
    elif cfg.static_activations:  # placeholders, overwritten by the saved scales
        scales = {f"{i}.{n}": torch.tensor(1.0, device=device) for i in range(len(layers)) for n in LINEARS}

    for i, layer in enumerate(bar(layers, f"Quantizing ({cfg})", "layer")):
        for name in LINEARS:
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, attr, quantize_linear(getattr(parent, attr), cfg, scales.get(f"{i}.{name}"), importance.get(f"{i}.{name}")))
        if cfg.mode == "w8a8":
            layer.input_layernorm = QuantRMSNorm(layer.input_layernorm, scales.get(f"{i}.self_attn.qkv_proj"), cfg.clip)
            layer.post_attention_layernorm = QuantRMSNorm(layer.post_attention_layernorm, scales.get(f"{i}.mlp.gate_up_proj"), cfg.clip)
            layer.mlp.act = SiluAndMulQuant(scales.get(f"{i}.mlp.down_proj"), cfg.clip)
    if cfg.mode in ("w8", "w4"):  # weight-only: the (often tied) embedding / lm_head too (QuantConfig.head)
        quantize_head(model, cfg.head)
    elif cfg.mode == "w8a8":
        # The lm_head stays float (as in FasterLLaMA) unless int8 groups of 32 hold it exactly, as
        # they do a GGUF's Q8_0 lm_head dequantized on loading: then it keeps the file's weights in
        # a quarter of the bytes (decode reads it every step). Saved checkpoints record the choice.
        head_cfg, head = cfg.head, None
        if not placeholders:
            head = quantize_linear(model.lm_head, head_cfg)
            cfg.int8_lm_head = holds_exactly(head, model.lm_head.weight)
        if cfg.int8_lm_head:
            quantize_head(model, head_cfg, head)
    model.quant_config = cfg


def holds_exactly(q: nn.Module, weight: torch.Tensor, rows: int = 4096) -> bool:
    """Whether quantized linear `q` dequantizes to exactly `weight` (compared a block of rows at a
    time: a vocabulary matrix in float is 100+ MB)."""
    n = weight.shape[0]
    return all(torch.equal(q.dequantize_rows(torch.arange(lo, min(n, lo + rows)), torch.float32), weight[lo : lo + rows].float())
               for lo in range(0, n, rows))


def quantize_head(model: LlamaForCausalLM, cfg: QuantConfig, head: nn.Module | None = None) -> None:
    """Weight-only quantization of the lm_head (or `head`, its quantized form already made) and the
    token embedding (tied: one matrix for both)."""
    dtype = model.dtype
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.lm_head = head if head is not None else quantize_linear(model.lm_head, cfg)
    if tied:
        model.embed_tokens = QuantizedEmbedding(model.lm_head, dtype)
    else:
        table = Linear(model.config.hidden_size, model.config.vocab_size)
        table.weight = model.embed_tokens.weight
        model.embed_tokens = QuantizedEmbedding(quantize_linear(table, cfg), dtype)


def smooth_layer(layer: nn.Module, config, act_amax: dict[str, torch.Tensor], alpha: float) -> None:
    """SmoothQuant on all four GEMMs of a decoder layer, each folded into what produces its input:
    qkv and gate_up into the RMSNorm weights, o_proj into the v rows of qkv (per KV channel, shared
    by the query heads of a group), down_proj into the `up` rows of gate_up (SiLU(g)*u/s = SiLU(g)*(u/s))."""
    attn, mlp = layer.self_attn, layer.mlp
    for norm, lin, name in ((layer.input_layernorm, attn.qkv_proj, "self_attn.qkv_proj"), (layer.post_attention_layernorm, mlp.gate_up_proj, "mlp.gate_up_proj")):
        s = calibrate.smoothing_factors(act_amax[name], lin.weight.data, alpha)
        norm.weight.data.div_(s.to(norm.weight.dtype))
        lin.weight.data.mul_(s.to(lin.weight.dtype)[None, :])
    # o_proj: input channel (head h, dim d) comes from v channel (h // group, d)
    groups = config.num_heads // config.num_kv_heads
    d = config.head_dim
    o_w = attn.o_proj.weight.data
    amax_v = act_amax["self_attn.o_proj"].view(config.num_kv_heads, groups, d).amax(dim=1)
    w_v = o_w.abs().amax(dim=0).view(config.num_kv_heads, groups, d).amax(dim=1)
    s_v = calibrate.smoothing_factors_from_amax(amax_v.reshape(-1), w_v.reshape(-1), alpha)  # [kv_size]
    v_rows = slice(config.q_size + config.kv_size, config.q_size + 2 * config.kv_size)
    attn.qkv_proj.weight.data[v_rows].div_(s_v[:, None].to(o_w.dtype))
    if attn.qkv_proj.bias is not None:
        attn.qkv_proj.bias.data[v_rows].div_(s_v.to(o_w.dtype))
    o_w.mul_(s_v.view(config.num_kv_heads, 1, d).expand(-1, groups, -1).reshape(1, -1).to(o_w.dtype))
    # down_proj: input channel j is SiLU(gate_j) * up_j
    inter = config.intermediate_size
    s_d = calibrate.smoothing_factors(act_amax["mlp.down_proj"], mlp.down_proj.weight.data, alpha)
    mlp.gate_up_proj.weight.data[inter:].div_(s_d[:, None].to(o_w.dtype))
    if mlp.gate_up_proj.bias is not None:
        mlp.gate_up_proj.bias.data[inter:].div_(s_d.to(o_w.dtype))
    mlp.down_proj.weight.data.mul_(s_d[None, :].to(o_w.dtype))


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's parameters (shared tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
