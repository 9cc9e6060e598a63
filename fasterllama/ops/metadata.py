"""AttentionMetadata: the engine's contract with the ops for one step — where each packed token's
K/V goes in the paged cache and which cache blocks each sequence reads. Built once a step by the
model runner (or once per CUDA-graph bucket over static buffers) and read by every layer's ops."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """Where the step's packed tokens go in the KV cache and which tokens each sequence owns.

    The cache of a layer is [num_blocks, kv_heads, block_size, head_dim]. Tokens of all sequences
    are packed with no padding: sequence i owns rows token_offsets[i]:token_offsets[i+1] of the
    step, has start_positions[i] tokens cached already, and keeps key position p in block
    block_tables[i, p // block_size], row p % block_size. Built once a step and shared by every
    layer."""

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + row of each token's K/V (-1: a padding row, stored nowhere)
    positions: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    start_positions: list[int]
    token_offsets: list[int]  # len = num_seqs + 1

    def __post_init__(self) -> None:
        # Sequences with one new token (decodes) are attended together in one batched call.
        sizes = [self.token_offsets[i + 1] - self.token_offsets[i] for i in range(self.num_seqs)]
        self._single = [i for i, n in enumerate(sizes) if n == 1]
        self.multi_token_seqs = [i for i, n in enumerate(sizes) if n != 1]
        lengths = [self.start_positions[i] + 1 for i in self._single]
        self.decode_lengths = torch.tensor(lengths, dtype=torch.int64, device=self.positions.device)
        self.decode_max_len = max(lengths, default=0)
        self.all_decode = not self.multi_token_seqs

    # Index tensors built on first use: a decode step on the C path needs none of them.
    @cached_property
    def decode_rows(self) -> torch.Tensor:
        return torch.tensor([self.token_offsets[i] for i in self._single], dtype=torch.int64, device=self.positions.device)

    @cached_property
    def decode_block_tables(self) -> torch.Tensor:
        """[num decoding seqs, max_blocks] int32, contiguous: the block tables the decode kernels read."""
        if self.all_decode:
            return self.block_tables
        return self.block_tables[torch.tensor(self._single, dtype=torch.int64, device=self.block_tables.device)].contiguous()

    @cached_property
    def first_token_rows(self) -> torch.Tensor:
        """Rows of tokens at position 0: attention sinks, whose activations dwarf the rest (see quant/)."""
        starts = [self.token_offsets[i] for i in range(self.num_seqs) if self.start_positions[i] == 0 and self.token_offsets[i + 1] > self.token_offsets[i]]
        return torch.tensor(starts, dtype=torch.int64, device=self.positions.device)

    @property
    def num_seqs(self) -> int:
        return len(self.start_positions)


def block_tables_tensor(tables: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Sequences' block tables as one [num_seqs, longest] int32 tensor, padded with block 0."""
    width = max(1, max((len(t) for t in tables), default=1))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
