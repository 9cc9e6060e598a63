"""ModelConfig: the one description of a LLaMA-family model, whatever file it came from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}  # config.json's model_type -> its class
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")
_ROPE_KEYS = {  # what each scaling reads (model.llama.rope_inv_freq)
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "freq_factors": ("factors",),
}


def read_json_object(path: str) -> dict[str, Any]:
    """A checkpoint folder's JSON settings file (config.json, tokenizer_config.json, ...): a file
    that cannot be read or is not a JSON object is a ModelLoadError naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def per_head(hidden: object, heads: object) -> int:
    """hidden // heads, or 0 where either is not a positive integer (ModelConfig then says which)."""
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads))
    return hidden // heads if ok else 0  # type: ignore[operator]


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral's window, when it is shorter than max_position_embeddings was
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # the model's recommended sampling (a HF folder's generation_config.json: SamplingParams fields),
    # the defaults of requests that leave them out, as vLLM applies them
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelLoadError(f"the model's {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        for key in _ROPE_KEYS.get(rope_type, ()):
            value = self.rope_scaling.get(key)
            numbers = value if key == "factors" and isinstance(value, list) else [value]
            if not numbers or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in numbers):
                raise ModelLoadError(f"rope scaling {rope_type!r} needs a positive {key}, got {value!r}")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a HF config.json (LlamaForCausalLM / MistralForCausalLM). model_type decides
        the model, as in transformers' AutoModelForCausalLM; architectures, where given, must agree.
        Mistral's sliding window (HF's Mistral applies it whatever `use_sliding_window` says) caps the
        context: within the window full attention is exactly the windowed one."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type is not None and model_type not in MODEL_TYPES:
            raise ModelLoadError(f"unsupported model_type {model_type!r} (supported: {', '.join(MODEL_TYPES)})")
        for arch in archs[:1]:
            if arch not in SUPPORTED_ARCHITECTURES:
                raise ModelLoadError(
                    f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
                )
        arch = MODEL_TYPES[model_type] if model_type is not None else (archs or ["LlamaForCausalLM"])[0]
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # (the MLP is SwiGLU: another activation would run as SiLU, wrongly)
            raise ModelLoadError(f"unsupported hidden_act {act!r} (supported: silu)")
        max_positions = cfg.get("max_position_embeddings", 131072 if arch == "MistralForCausalLM" else 2048)  # (HF's defaults)
        window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None  # (HF's Llama has none)
        if window is not None and not (isinstance(window, int) and window > 0):
            raise ModelLoadError(f"config.json's sliding_window must be a positive integer or null, got {window!r}")
        if window is not None and window >= max_positions:
            window = None
        try:
            hidden = cfg["hidden_size"]
            heads = cfg["num_attention_heads"]
            rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
            rope_theta = cfg.get("rope_theta") or (rope_scaling or {}).get("rope_theta", 10000.0)
            if rope_scaling is not None:
                rope_scaling = dict(rope_scaling)
                rope_scaling["rope_type"] = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
                if rope_scaling["rope_type"] == "default":
                    rope_scaling = None
            eos = cfg.get("eos_token_id")
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or per_head(hidden, heads),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                max_position_embeddings=max_positions if window is None else window,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=window,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from None

    def num_parameters(self) -> int:
        """Weights of the whole model (an untied lm_head counted; a tied one is the embedding)."""
        h, qkv = self.hidden_size, self.q_size + 2 * self.kv_size
        attention = h * qkv + self.q_size * h + ((qkv + h) if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size + ((2 * self.intermediate_size + h) if self.mlp_bias else 0)
        return self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * (attention + mlp + 2 * h) + h

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape a checkpoint tensor of this (canonical, HF) name must have, [out, in] for a
        linear's weight; None for names this checks nothing of."""
        h, inter, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        weights = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h), "up_proj": (inter, h),
                   "down_proj": (h, inter), "embed_tokens": (self.vocab_size, h), "lm_head": (self.vocab_size, h),
                   "input_layernorm": (h,), "post_attention_layernorm": (h,), "norm": (h,)}
        part, kind = name.rsplit(".", 2)[-2:]
        shape = weights.get(part)
        return shape if kind == "weight" or shape is None else shape[:1]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
