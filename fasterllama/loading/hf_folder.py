"""Read a HF checkpoint folder: config.json + (sharded) safetensors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..config import ModelConfig, read_json_object
from ..errors import ModelLoadError

# generation_config.json's keys that vLLM takes as sampling defaults -> SamplingParams' names
_SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class HFCheckpoint:
    path: str
    config: ModelConfig
    shards: dict[str, list[str]]  # shard file -> tensor names in it
    quantization: dict | None = None  # quantization_config of a `fasterllama quantize` checkpoint

    def tensor_names(self) -> list[str]:
        return [n for names in self.shards.values() for n in names]

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        for shard, names in self.shards.items():
            for name in names:
                try:  # the file opened (mapped) for each tensor: pages read stay mapped only while it is
                    with safe_open(shard, framework="pt") as f:  # open, not the whole load (a 2 GB file added 2 GB to the peak RSS)
                        tensor = f.get_tensor(name)
                except (OSError, ValueError, SafetensorError) as e:
                    raise ModelLoadError(f"{shard}: cannot read safetensors ({e})") from None
                yield name, tensor


def _tensor_names(shard: str) -> list[str]:
    """The tensors a safetensors file holds (its header only): a truncated or corrupt file fails
    here, before the model is built, not halfway through the load."""
    from safetensors import safe_open

    try:
        with safe_open(shard, framework="pt") as f:
            return list(f.keys())
    except Exception as e:
        raise ModelLoadError(f"{shard}: cannot read safetensors ({e})") from None


def open_hf_folder(path: str) -> HFCheckpoint:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf")) if os.path.isdir(path) else []
        hint = f"; it holds GGUF files: give one as the model, e.g. {os.path.join(path, ggufs[0])}" if ggufs else ""
        raise ModelLoadError(f"{path}: no config.json (expected a HF checkpoint folder or a .gguf file){hint}")
    raw_config = read_json_object(cfg_path)
    config = ModelConfig.from_hf_dict(raw_config)
    quantization = raw_config.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise ModelLoadError(f"{cfg_path}: quantization_config should be an object, got {quantization!r}")
    if quantization is not None and quantization.get("quant_method") != "fasterllama":
        raise ModelLoadError(f"{path}: unsupported quantization method {quantization.get('quant_method')!r} (quantize with `fasterllama quantize` instead)")
    gen_cfg_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_cfg_path):
        generation = read_json_object(gen_cfg_path)
        eos = generation.get("eos_token_id")
        if eos is not None:
            eos = [eos] if isinstance(eos, int) else list(eos)
            config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + eos))
        config.sampling_defaults = {ours: generation[theirs] for theirs, ours in _SAMPLING_DEFAULTS.items() if generation.get(theirs) is not None}

    index_path = os.path.join(path, "model.safetensors.index.json")
    single_path = os.path.join(path, "model.safetensors")
    shards: dict[str, list[str]] = {}
    if os.path.isfile(index_path):
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: no weight_map")
        for name, shard in weight_map.items():
            shards.setdefault(os.path.join(path, shard), []).append(name)
        for shard, names in shards.items():
            if not os.path.isfile(shard):
                raise ModelLoadError(f"{path}: missing shard {os.path.basename(shard)}")
            absent = set(names) - set(_tensor_names(shard))
            if absent:
                raise ModelLoadError(f"{shard}: lacks {len(absent)} tensors the index puts there, e.g. {min(absent)!r}")
    elif os.path.isfile(single_path):
        shards[single_path] = _tensor_names(single_path)
    else:
        pickled = any(f.endswith((".bin", ".pt")) for f in os.listdir(path))
        hint = " (its PyTorch .bin weights are not read: save them as safetensors, e.g. with transformers' save_pretrained)" if pickled else ""
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json{hint}")
    return HFCheckpoint(path=path, config=config, shards=shards, quantization=quantization)
