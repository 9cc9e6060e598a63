"""The decoder-only LLaMA family (LLaMA 2/3, Mistral without sliding window, SmolLM, TinyLlama).

One forward for both phases: the step's tokens of all sequences are packed into one [T] batch
(prefill chunks and single decode tokens alike), K/V go into a preallocated cache, and
attention reads each sequence's own cache rows (see ops.AttentionMetadata)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..errors import ModelLoadError

HALF_TYPES = (torch.float16, torch.bfloat16)


class Linear(nn.Module):
    """y = x W^T (+ b). Quantized linears keep this call signature."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream too, adds x to it first and returns (normed, new residual):
    one op (ops.add_rms_norm) that a backend can fuse into one pass over the hidden states."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2], with linear / llama3 / per-frequency-factor scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":  # llama.cpp's rope_freqs tensor: theta = pos * inv_freq / factor
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: ops.AttentionMetadata) -> torch.Tensor:
        """Attention from the qkv projection's output (the layer applies qkv_proj with the norm before it)."""
        T = cos.shape[0]
        out = ops.rope_store_attention(qkv, cos, sin, kv, meta, self.num_heads, self.num_kv_heads, self.head_dim, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(gate_up)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.act = SiluAndMul()
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's second half from gate_up_proj's output (the layer applies gate_up_proj with the norm before it)."""
        if type(self.act) is SiluAndMul:  # (w8a8 replaces act by a quantizing one)
            return ops.silu_and_mul_linear(gate_up, self.down_proj)
        return self.down_proj(self.act(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
        meta: ops.AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual add is left to
        the next norm, which fuses it (h_out = residual + mlp output), and each norm goes with the
        linear after it into one op (ops.rms_norm_linear), which a backend may make one kernel."""
        (attn_norm, qkv_proj), (mlp_norm, gate_up_proj) = self.normed_linears()
        qkv, residual = ops.rms_norm_linear(h, residual, attn_norm, qkv_proj)
        h = self.self_attn(qkv, cos, sin, kv, meta)
        gate_up, residual = ops.rms_norm_linear(h, residual, mlp_norm, gate_up_proj)
        return self.mlp(gate_up), residual

    def normed_linears(self) -> tuple[tuple[nn.Module, nn.Module], ...]:
        """Each norm and the linear that reads its output (the GPU backend times them fused)."""
        return (self.input_layernorm, self.self_attn.qkv_proj), (self.post_attention_layernorm, self.mlp.gate_up_proj)


# canonical checkpoint name suffix -> (fused parameter, shard index among its parts)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _checkpoint_name(key: str) -> str:
    """A parameter key of load_weights ("layers.1.mlp.gate_up_proj.weight#1") as the checkpoint names
    its tensor ("model.layers.1.mlp.up_proj.weight")."""
    name, _, part = key.partition("#")
    for src, (fused, idx) in _FUSED.items():
        if part and f".{fused}." in name and int(part) == idx:
            name = name.replace(f".{fused}.", f".{src}.")
    return name if name.startswith("lm_head") else f"model.{name}"


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # _weight: no random init (on meta, normal_ alone loads torch's meta kernels: +126 MB resident)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta"))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, input_ids: torch.Tensor, meta: ops.AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the packed tokens `input_ids` [T]."""
        cos, sin = self.rope_tables(meta.positions)
        h, residual = self.embed_tokens(input_ids).to(self.dtype), None  # (a 16-bit table's rows, widened)
        with ops.step(meta):
            for layer, kv in zip(self.layers, kv_caches):
                h, residual = layer(h, residual, cos, sin, kv, meta)
        return self.norm(h, residual)[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in: its norms' (matrices may be stored narrower, see load_weights)."""
        return self.norm.weight.dtype

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of each position's RoPE angles (rotate-half layout), once a step."""
        return ops.rope_tables(positions, self.inv_freq)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # -- loading ------------------------------------------------------------------------------
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device, skip: Iterable[str] = (),
                     keep_16bit: bool = False) -> None:
        """Fill parameters from canonical (HF-named) tensors, one at a time, converting dtype.

        Fused projections (qkv, gate_up) are allocated once and filled slice by slice, so the
        load never holds a second full copy of the weights. keep_16bit: matrices stored in fp16 or
        bf16 stay so in an fp32 model (for kernels that widen them exactly as they compute)."""
        cfg = self.config
        params = dict(self.named_parameters(remove_duplicate=False))
        seen: set[str] = set()
        split_sizes = {
            "qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
            "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
        }
        for name, tensor in tensors:
            target = name.removeprefix("model.")
            part = None
            for src, (fused, idx) in _FUSED.items():
                if f".{src}." in target:
                    target, part = target.replace(f".{src}.", f".{fused}."), (fused, idx)
                    break
            if target not in params:
                if "rotary_emb" in target:
                    continue
                raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint")
            if not tensor.is_floating_point():  # (an int8 tensor cast to float would load as wrong weights, silently)
                raise ModelLoadError(f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}: a float checkpoint's tensors are float "
                                     "(quantized ones: GGUF files, or checkpoints saved by `fasterllama quantize`)")
            param = params[target]
            stored = tensor.dtype if keep_16bit and dtype == torch.float32 and tensor.dim() == 2 and tensor.dtype in HALF_TYPES else dtype
            if param.device.type == "meta":
                param = self._materialize(target, stored, device)
                params[target] = param
            elif param.dtype != stored and param.dtype != dtype:  # a fused matrix's parts stored in different types: all in the model's dtype
                param = self._materialize(target, dtype, device, param)
                params[target] = param
            if part is None:
                expected = tuple(param.shape)
                if tuple(tensor.shape) != expected:
                    raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
                param.data.copy_(tensor)
                seen.add(target)
            else:
                sizes = split_sizes[part[0]]
                lo = sum(sizes[: part[1]])
                dst = param.data[lo : lo + sizes[part[1]]]
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(tensor)
                seen.add(f"{target}#{part[1]}")
        for name in skip:  # (after the tensors: their iterator may fill it as it goes)
            target = name.removeprefix("model.")
            fused = next((f for f in split_sizes if f".{f}." in target), None)
            seen.update([f"{target}#{i}" for i in range(len(split_sizes[fused]))] if fused else [target])
        if "embed_tokens.weight" in seen and self.embed_tokens.weight.device.type == "meta":
            seen.add("lm_head.weight")  # the caller provides the embedding (and ties lm_head to it)
        elif cfg.tie_word_embeddings:  # (untied and absent: an error below, as in vLLM; HF would start it at random)
            self.lm_head.weight = self.embed_tokens.weight
            seen.add("lm_head.weight")
        missing = []
        for pname, _p in self.named_parameters():
            fused = next((f for f in split_sizes if f".{f}." in pname), None)
            keys = [f"{pname}#{i}" for i in range(len(split_sizes[fused]))] if fused else [pname]
            missing += [k for k in keys if k not in seen]
        if missing:
            untied = " (the config does not tie it to the embedding: tie_word_embeddings is false)" if missing == ["lm_head.weight"] else ""
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {_checkpoint_name(missing[0])!r}{untied}")
        self.inv_freq = self.inv_freq.to(device)

    def widen_weights(self) -> None:
        """Matrices kept 16-bit in an fp32 model (load_weights' keep_16bit) widened to its dtype, ties
        kept: what quantizing and smoothing work on."""
        widened: dict[int, nn.Parameter] = {}
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.dtype != self.dtype and p.dtype in HALF_TYPES:
                    if id(p) not in widened:
                        widened[id(p)] = nn.Parameter(p.data.to(self.dtype), requires_grad=False)
                    module._parameters[name] = widened[id(p)]

    def _materialize(self, target: str, dtype: torch.dtype, device: torch.device, copy: torch.Tensor | None = None) -> nn.Parameter:
        """A real parameter in place of a meta one (or of `copy`, whose values it takes)."""
        module_name, _, attr = target.rpartition(".")
        module = self.get_submodule(module_name)
        old = getattr(module, attr)
        new = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=device) if copy is None else copy.to(dtype), requires_grad=False)
        setattr(module, attr, new)
        return new
