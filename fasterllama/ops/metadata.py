"""AttentionMetadata: the engine's contract with the ops for one step — where each packed token's
K/V goes in the cache and which tokens each sequence owns. Built once a step by the model runner
(or once per CUDA-graph bucket over static buffers) and read by every layer's ops."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """Where the step's packed tokens go in the KV cache and which tokens each sequence owns.

    Tokens of all sequences are packed with no padding: sequence i owns rows
    token_offsets[i]:token_offsets[i+1] of the step, sits in cache slot slots[i], and has
    start_positions[i] tokens already cached. Built once a step and shared by every layer."""

    slot_of_token: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: list[int]
    start_positions: list[int]
    token_offsets: list[int]  # len = num_seqs + 1

    def __post_init__(self) -> None:
        # Sequences with one new token (decodes) are attended together in one batched call.
        single = [i for i in range(self.num_seqs) if self.token_offsets[i + 1] - self.token_offsets[i] == 1]
        self.multi_token_seqs = [i for i in range(self.num_seqs) if self.token_offsets[i + 1] - self.token_offsets[i] != 1]
        self._single = single
        self.decode_slots = [self.slots[i] for i in single]
        lengths = [self.start_positions[i] + 1 for i in single]
        self.decode_lengths = torch.tensor(lengths, dtype=torch.int64, device=self.positions.device)
        self.decode_max_len = max(lengths, default=0)
        first = self.decode_slots[0] if single else 0
        # consecutive slots can be read as a view of the cache, others are gathered
        self.decode_slot_range = (first, first + len(single)) if self.decode_slots == list(range(first, first + len(single))) else None
        self.all_decode = not self.multi_token_seqs

    # Index tensors built on first use: a decode step on the C path needs none of them.
    @cached_property
    def decode_rows(self) -> torch.Tensor:
        return torch.tensor([self.token_offsets[i] for i in self._single], dtype=torch.int64, device=self.positions.device)

    @cached_property
    def decode_slot_index(self) -> torch.Tensor:
        return torch.tensor(self.decode_slots, dtype=torch.int64, device=self.positions.device)

    @cached_property
    def first_token_rows(self) -> torch.Tensor:
        """Rows of tokens at position 0: attention sinks, whose activations dwarf the rest (see quant/)."""
        starts = [self.token_offsets[i] for i in range(self.num_seqs) if self.start_positions[i] == 0 and self.token_offsets[i + 1] > self.token_offsets[i]]
        return torch.tensor(starts, dtype=torch.int64, device=self.positions.device)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)
