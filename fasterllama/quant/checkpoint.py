"""Quantized checkpoints: `fasterllama quantize` writes a folder (config.json with a
quantization_config, model.safetensors with the quantized tensors under the engine's own names,
the tokenizer) that LLM() loads back without re-quantizing or re-calibrating."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import FasterLlamaError
from ..tokenizer import Tokenizer
from .config import QuantConfig

QUANT_METHOD = "fasterllama"


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
    }


def save_tokenizer(tok: Tokenizer, out_dir: str) -> None:
    tok.backend.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
        "add_eos_token": False,
        "chat_template": tok.chat_template,
        **{k: v for k, v in tok.special_tokens.items() if k not in ("bos_token", "eos_token") and v is not None},
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2, ensure_ascii=False)


def save_quantized(engine: Any, out_dir: str) -> None:
    """Write the engine's quantized model as a self-contained checkpoint folder."""
    from safetensors.torch import save_file

    if engine.quant_config is None or isinstance(engine.quant_config, str):
        raise FasterLlamaError("only models quantized with a mode (w8, w4, w8a8...) can be saved")
    os.makedirs(out_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(out_dir, "*.safetensors.index.json")) + glob.glob(os.path.join(out_dir, "*-of-*.safetensors")):
        os.remove(stale)  # (a sharded checkpoint overwritten: its index would be read instead of ours)
    tensors: dict[str, torch.Tensor] = {}
    first_name: dict[tuple[str, int], str] = {}
    tied: dict[str, str] = {}
    # ties (embedding / lm_head) by parameter identity: state_dict() may hand out converted copies
    # (weights in panels are saved in the row layout)
    owner = {name: id(p) for name, p in engine.model.named_parameters(remove_duplicate=False)}
    for name, t in engine.model.state_dict().items():
        keys = [("storage", t.data_ptr())] + ([("param", owner[name])] if name in owner else [])
        seen = next((first_name[k] for k in keys if k in first_name), None)
        if seen is not None:  # the same tensor under two names (tied embedding / lm_head)
            tied[name] = seen
            continue
        first_name.update((k, name) for k in keys)
        tensors[name] = t.detach().contiguous().cpu()
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # (safetensors writes it 0600: others could read config.json but not the weights)
    config = hf_config_dict(engine.config)
    config["quantization_config"] = {"quant_method": QUANT_METHOD, **engine.quant_config.to_dict(), "tied": tied}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    save_tokenizer(engine.tokenizer, out_dir)


def load_quantized(model: torch.nn.Module, quant: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device) -> QuantConfig:
    """Rebuild the quantized module structure (on placeholder weights) and load the saved tensors."""
    from .convert import quantize_model

    fields = {k: v for k, v in quant.items() if k in QuantConfig.__dataclass_fields__}
    if fields.get("mode") == "w4":
        fields.setdefault("head_bits", 4)  # saved before the 8-bit head became w4's default
    qcfg = QuantConfig(**fields)
    for name, p in list(model.named_parameters()):
        if p.device.type == "meta":
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, attr, torch.nn.Parameter(torch.zeros(p.shape, dtype=dtype, device=device), requires_grad=False))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    quantize_model(model, qcfg, placeholders=True)
    state = dict(tensors)
    for alias, source in quant.get("tied", {}).items():
        state[alias] = state[source]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise FasterLlamaError(f"quantized checkpoint does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.to(device)
    return qcfg
