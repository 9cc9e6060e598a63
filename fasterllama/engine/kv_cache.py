"""KV cache: preallocated per layer as [slots, kv_heads, max_len, head_dim]; one slot a sequence.

torch.empty leaves pages untouched until written, so resident memory grows with the tokens
actually cached, not with max_len."""

from __future__ import annotations

import torch

from ..config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.layers = [
            (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.num_slots, self.max_len = num_slots, max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def copy_slots(self, src: list[int], dst: list[int], length: int) -> None:
        """Make slots dst[i] hold the first `length` cached tokens of src[i] (src may overlap dst)."""
        src_t = torch.tensor(src, device=self.layers[0][0].device)
        dst_t = torch.tensor(dst, device=self.layers[0][0].device)
        for k, v in self.layers:
            k[dst_t, :, :length] = k[src_t, :, :length]
            v[dst_t, :, :length] = v[src_t, :, :length]

    def free(self, slot: int) -> None:
        self._free.append(slot)
