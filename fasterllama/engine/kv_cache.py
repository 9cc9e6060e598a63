"""The paged KV cache: per layer, K and V as [num_blocks, kv_heads, block_size, head_dim] views.

A sequence's keys live in whichever blocks its block table names (BlockManager hands them out),
so the cache is sized by memory rather than by max_num_seqs x max_model_len, and sequences with a
common prefix share its blocks. In memory each head's blocks follow one another ([kv_heads,
num_blocks, ...]): consecutive blocks of a sequence read as one stream per head, which the CPU's
decode attention needs to run at the speed of a contiguous per-sequence cache (kernels take any
strides). On the CPU torch.empty leaves pages untouched until written, so resident memory grows
with the blocks actually used."""

from __future__ import annotations

import re

import torch

from ..config import ModelConfig
from ..errors import FasterLlamaError
from ..host_memory import free_memory

DEFAULT_CPU_MEMORY = 2 << 30  # the CPU default cap (pages are touched only as blocks are used)
DEFAULT_GPU_FRACTION = 0.8  # of the device memory free once the model is loaded


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.layers = [
            (torch.empty(shape, dtype=dtype, device=device).transpose(0, 1), torch.empty(shape, dtype=dtype, device=device).transpose(0, 1))
            for _ in range(cfg.num_layers)
        ]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * dtype.itemsize

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Make blocks dst[i] hold what blocks src[i] hold, in every layer (copy-on-write)."""
        device = self.layers[0][0].device
        src_t, dst_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for k, v in self.layers:
            k[dst_t] = k[src_t]
            v[dst_t] = v[src_t]


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_memory(value: float | str) -> int | float:
    """Bytes (an int, or "2GiB", "512MB", "1e9") or a fraction of free memory (a float in (0, 1], or "0.5")."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise FasterLlamaError(f"kv_cache_memory {value!r} is not a size such as 2GiB, 512MB or 0.5 (a fraction of free memory)")
        number, unit = float(m.group(1)), m.group(2).lower()
        if not unit and "." in m.group(1) and "e" not in m.group(1).lower():  # a fraction; "1.5" is neither that nor bytes ("1.5e9" is)
            value = number
        else:
            value = int(number * _UNITS[unit])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FasterLlamaError(f"kv_cache_memory must be bytes (an int or a string such as 2GiB) or a fraction of free memory, got {value!r}")
    if isinstance(value, float) and not 0 < value <= 1:
        raise FasterLlamaError(f"kv_cache_memory as a fraction of free memory must be in (0, 1], got {value}")
    if isinstance(value, int) and value <= 0:
        raise FasterLlamaError(f"kv_cache_memory must be positive, got {value}")
    return value


def memory_budget(memory: float | str, device: torch.device) -> int:
    """kv_cache_memory in bytes, refused where it exceeds the free memory (the engine asks once
    before the model loads, so a size that cannot fit fails in a second, not after the load)."""
    memory = parse_memory(memory)
    free = free_memory(device, with_swap=True)
    budget = int(free_memory(device) * memory) if isinstance(memory, float) else memory
    if free is not None and budget > free:  # (a host allocation this large may succeed, and fail when the cache fills)
        raise FasterLlamaError(f"kv_cache_memory of {budget / 2**30:.1f} GiB exceeds the {free / 2**30:.1f} GiB free on {device.type}")
    return budget


def num_blocks_for(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, memory: float | str | None, block_size: int,
                   max_num_seqs: int, max_model_len: int) -> int:
    """How many blocks the cache gets. By default: on the CPU up to DEFAULT_CPU_MEMORY, on a GPU
    DEFAULT_GPU_FRACTION of the free memory, never more than max_num_seqs full-length sequences
    need and never less than one full-length sequence needs."""
    per_block = KVCache.bytes_per_block(cfg, block_size, dtype)
    blocks_per_seq = -(-max_model_len // block_size)
    if memory is None:
        budget = int(free_memory(device) * DEFAULT_GPU_FRACTION) if device.type == "cuda" else DEFAULT_CPU_MEMORY
        return max(blocks_per_seq, min(budget // per_block, max_num_seqs * blocks_per_seq))
    budget = memory_budget(memory, device)
    if budget < per_block:
        raise FasterLlamaError(f"kv_cache_memory of {budget} bytes is less than one KV cache block ({per_block} bytes: "
                               f"{block_size} tokens x {cfg.num_layers} layers)")
    return budget // per_block
