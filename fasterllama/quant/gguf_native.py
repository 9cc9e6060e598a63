"""Load a GGUF file keeping its Q8_0 / Q5_0 / Q4_0 / Q4_1 tensors quantized (repacked exactly into
the engine's int8 / int4 layouts), so weight memory stays near the file size. Other tensor types
are expanded to float as usual: Q6_K's scales cover 16 columns, which the int8 kernels' groups of
32 cannot hold; Q4_K / Q5_K / Q5_1 have no exact int8 or fp16-scaled 4-bit form."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..loading.gguf_file import GGUFCheckpoint, _dequantize, canonical_name, unpermute_rope_rows
from ..model.llama import LlamaForCausalLM
from .linear import Int4Linear, Int8Linear, QuantizedEmbedding

NATIVE_TYPES = ("Q8_0", "Q5_0", "Q4_0", "Q4_1")
# w = d * (q - 16), q 5-bit: int8 values q - 16 with Q8_0's scale per 32 columns, so Int8Linear
INT8_TYPES = {"Q8_0", "Q5_0"}
# fused parameter -> its canonical parts, in row order
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def decode_blocks(data: np.ndarray, type_name: str, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw GGUF blocks [rows, bytes] -> (q [rows, K] int, scale [rows, K/32], min or None)."""
    raw = np.ascontiguousarray(data).reshape(rows, -1)
    size = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18, "Q4_1": 20}[type_name]
    blocks = raw.reshape(rows, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(rows, -1), d, None
    if type_name == "Q5_0":  # 4 bytes of fifth bits (little-endian, bit j for element j), then nibbles
        high = blocks[..., 2:6].copy().view("<u4")[..., 0][..., None] >> np.arange(32, dtype=np.uint32) & 1
        low = np.concatenate((blocks[..., 6:] & 15, blocks[..., 6:] >> 4), axis=-1)  # element j, then j+16
        return ((low | high.astype(np.uint8) << 4).astype(np.int8) - 16).reshape(rows, -1), d, None
    offset = 2 if type_name == "Q4_0" else 4
    nibbles = blocks[..., offset:]
    q = np.concatenate((nibbles & 15, nibbles >> 4), axis=-1).reshape(rows, -1)  # element j, then j+16
    if type_name == "Q4_0":
        return q, d, -8 * d  # w = d * (q - 8)
    return q, d, blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)


def _module(parts: list[tuple[str, np.ndarray, np.ndarray, np.ndarray | None]]) -> nn.Module:
    types = {p[0] for p in parts}
    q = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    scale = torch.from_numpy(np.concatenate([p[2] for p in parts]))
    if types <= INT8_TYPES:
        return Int8Linear(q.to(torch.int8), scale)
    if types <= {"Q4_0", "Q4_1"}:
        mins = torch.from_numpy(np.concatenate([p[3] for p in parts]))
        return Int4Linear(q, scale, mins)
    raise TypeError  # mixed int8 / int4 parts: the caller expands them to float


def load_gguf_native(model: LlamaForCausalLM, ckpt: GGUFCheckpoint, dtype: torch.dtype, device: torch.device, progress=None) -> None:
    cfg = model.config
    floats: list[tuple[str, torch.Tensor]] = []
    pending: dict[str, dict[str, tuple]] = {}  # fused projections waiting for their other parts
    quantized: dict[str, nn.Module] = {}
    for t in ckpt.reader.tensors:
        name = canonical_name(t.name)
        if name is None:
            continue
        if progress is not None:
            progress.update(1)
        type_name = t.tensor_type.name
        is_linear = name.endswith(".weight") and ("_proj." in name or name.startswith(("lm_head", "model.embed_tokens")))
        if type_name not in NATIVE_TYPES or not is_linear:
            arr = _dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                arr = unpermute_rope_rows(arr, cfg.num_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                arr = unpermute_rope_rows(arr, cfg.num_kv_heads)
            floats.append((name, torch.from_numpy(arr)))
            continue
        rows = int(t.shape[1])
        q, scale, mins = decode_blocks(t.data, type_name, rows)
        if ".q_proj." in name or ".k_proj." in name:  # undo llama.cpp's row permutation, exactly
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            q, scale = unpermute_rope_rows(q, heads), unpermute_rope_rows(scale, heads)
            mins = None if mins is None else unpermute_rope_rows(mins, heads)
        ckpt._release_pages(t.data_offset, t.n_bytes)
        part = (type_name, q, scale, mins)
        fused = next((f for f, ps in _PARTS.items() if any(f".{p}." in name for p in ps)), None)
        target, src = name, ""
        if fused is not None:
            src = next(p for p in _PARTS[fused] if f".{p}." in name)
            target = name.replace(f".{src}.", f".{fused}.")
        pending.setdefault(target, {})[src] = part
        order = _PARTS[fused] if fused else ("",)
        if all(p in pending[target] for p in order):  # complete: build it now, free the arrays
            parts = pending.pop(target)
            try:
                quantized[target] = _module([parts[p] for p in order]).to(device)
            except TypeError:  # mixed types in one fused projection: expand them to float
                for p in order:
                    _, pq, ps, pm = parts[p]
                    floats.append((target.replace(f".{fused}.", f".{p}.") if fused else target, _dequantize_parts(pq, ps, pm)))
    for target, parts in pending.items():  # fused projections with parts of other types: float
        fused = next(f for f in _PARTS if f".{f}." in target)
        for p, (_, pq, ps, pm) in parts.items():
            floats.append((target.replace(f".{fused}.", f".{p}."), _dequantize_parts(pq, ps, pm)))
    model.load_weights(floats, dtype, device, skip=set(quantized))
    for target, module in quantized.items():
        path = target.removeprefix("model.").removesuffix(".weight")
        if path == "embed_tokens":
            model.embed_tokens = QuantizedEmbedding(module, dtype)
        else:
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, module)
    if "model.embed_tokens.weight" in quantized and "lm_head.weight" not in quantized and "lm_head.weight" not in {n for n, _ in floats}:
        model.lm_head = model.embed_tokens.table  # tied: one quantized matrix serves both


def _dequantize_parts(q: np.ndarray, scale: np.ndarray, mins: np.ndarray | None) -> torch.Tensor:
    rows, k = q.shape
    g = q.reshape(rows, -1, 32).astype(np.float32)
    w = g * scale[..., None] + (0 if mins is None else mins[..., None])
    return torch.from_numpy(w.reshape(rows, k))
