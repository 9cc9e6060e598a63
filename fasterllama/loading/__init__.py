"""Loading: GGUF files and HF folders -> one canonical set of named tensors + ModelConfig + Tokenizer.

Nothing downstream knows which format a model came from."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ModelLoadError
from .registry import DEFAULT_MODEL, KNOWN_MODELS, resolve_model_path

if TYPE_CHECKING:  # (the formats' readers import torch: `fasterllama models` needs none of them)
    import torch

    from ..config import ModelConfig
    from ..tokenizer import Tokenizer


@dataclass
class Checkpoint:
    path: str
    format: str  # "gguf" | "hf"
    config: ModelConfig
    tokenizer: Tokenizer
    tensor_names: list[str]
    iter_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    source: object = None  # the format's own reader (GGUFCheckpoint / HFCheckpoint)


def open_checkpoint(model: str | None) -> Checkpoint:
    """Open a model by path or known name; tensors are read lazily by `iter_tensors()`."""
    from ..tokenizer import Tokenizer

    path, fmt, ckpt = _open_format(model)
    if fmt == "hf":
        tokenizer = Tokenizer.from_folder(path)
    else:
        tokenizer = Tokenizer.from_gguf(ckpt.metadata)
        ckpt.drop_metadata()
    cfg = ckpt.config
    if cfg.bos_token_id is None:
        cfg.bos_token_id = tokenizer.bos_token_id
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in cfg.eos_token_ids:
        cfg.eos_token_ids.append(tokenizer.eos_token_id)  # (ends sequences besides the config's, as in vLLM: a chat model's end-of-turn)
    return Checkpoint(path, fmt, cfg, tokenizer, ckpt.tensor_names(), ckpt.iter_tensors, ckpt)


def read_config(model: str | None) -> ModelConfig:
    """The model's config alone (no tokenizer, no tensors): for checks that must fail before any work starts."""
    return _open_format(model)[2].config


def _open_format(model: str | None) -> tuple[str, str, Any]:
    from .gguf_file import open_gguf
    from .hf_folder import open_hf_folder

    path = resolve_model_path(model)
    if os.path.isdir(path):
        return path, "hf", open_hf_folder(path)
    if path.endswith(".gguf") or _has_gguf_magic(path):
        return path, "gguf", open_gguf(path)
    raise ModelLoadError(f"{path}: not a GGUF file or a HF checkpoint folder")


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None


__all__ = ["Checkpoint", "open_checkpoint", "read_config", "resolve_model_path", "KNOWN_MODELS", "DEFAULT_MODEL"]
