"""ModelRunner: packs a step's tokens with no padding, runs the model (or the backend's whole-step
decode where it covers the step), returns the logits of the positions that sample."""

from __future__ import annotations

import torch

from .. import ops
from ..backends import Backend, DecodePlan
from ..model import LlamaForCausalLM
from .kv_cache import KVCache
from .scheduler import ScheduledSeq


def pack_batch(batch: list[ScheduledSeq], block_size: int, device: torch.device) -> tuple[torch.Tensor, ops.AttentionMetadata]:
    """The step's new tokens of every sequence, packed, and where each goes in the KV cache."""
    tokens: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    offsets = [0]
    for item in batch:
        seq, n = item.seq, item.num_tokens
        start, table, bs = seq.num_cached, seq.block_table, block_size
        tokens += seq.token_ids(start, start + n)
        positions += range(start, start + n)
        slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        offsets.append(offsets[-1] + n)
    meta = ops.AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        block_tables=ops.block_tables_tensor([item.seq.block_table for item in batch], device),
        start_positions=[item.seq.num_cached for item in batch],
        token_offsets=offsets,
    )
    return torch.tensor(tokens, dtype=torch.int64, device=device), meta


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: Backend, max_num_seqs: int, max_model_len: int) -> None:
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len  # the whole-step decode's static shapes
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = backend.device
        self.decode_plan: DecodePlan | None = None
        self.refresh_decode_plan()

    def refresh_decode_plan(self) -> None:
        """(Re)prepare the weights for the backend's kernels (panels and huge pages on the CPU) and
        its whole-step decode; needed after modules change (quantization)."""
        self.decode_plan = None  # let go of the old tensors before they move
        self.backend.prepare_model(self.model)
        self.decode_plan = self.backend.decode_plan(self.model, self.kv_cache, self.max_num_seqs, self.max_model_len)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], rows: list[int] | None = None) -> torch.Tensor:
        """Run one step; fp32 logits of the given packed-token rows (default: every row). The
        caller advances the sequences (Scheduler.advance)."""
        self.backend.begin_step()
        index = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=self.device)
        if self.decode_plan is not None and self.decode_plan.covers(batch):
            logits = self.decode_plan.run(batch)  # embedding to logits in one call
            logits = logits if index is None else logits[index]
        else:
            input_ids, meta = pack_batch(batch, self.kv_cache.block_size, self.device)
            hidden = self.model(input_ids, meta, self.kv_cache.layers)
            logits = self.model.compute_logits(hidden if index is None else hidden[index]).float()
        return logits
