"""ModelRunner: packs a step's tokens with no padding, runs the model (or the backend's whole-step
decode where it covers the step), returns the logits of the positions that sample."""

from __future__ import annotations

import torch

from .. import ops
from ..backends import Backend, DecodePlan
from ..model import LlamaForCausalLM
from .kv_cache import KVCache
from .scheduler import ScheduledSeq


def pack_batch(batch: list[ScheduledSeq], device: torch.device) -> tuple[torch.Tensor, ops.AttentionMetadata]:
    """The step's new tokens of every sequence, packed, and where each goes in the KV cache."""
    tokens: list[int] = []
    positions: list[int] = []
    slot_of_token: list[int] = []
    offsets = [0]
    for item in batch:
        seq, n = item.seq, item.num_tokens
        start = seq.num_cached
        tokens += seq.token_ids(start, start + n)
        positions += range(start, start + n)
        slot_of_token += [seq.slot] * n
        offsets.append(offsets[-1] + n)
    meta = ops.AttentionMetadata(
        slot_of_token=torch.tensor(slot_of_token, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slots=[item.seq.slot for item in batch],
        start_positions=[item.seq.num_cached for item in batch],
        token_offsets=offsets,
    )
    return torch.tensor(tokens, dtype=torch.int64, device=device), meta


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: Backend) -> None:
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
        self.decode_plan = self.backend.decode_plan(self.model, self.kv_cache)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], rows: list[int] | None = None) -> torch.Tensor:
        """Run one step; fp32 logits of the given packed-token rows (default: every row)."""
        index = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=self.device)
        if self.decode_plan is not None and self.decode_plan.covers(batch):
            logits = self.decode_plan.run(batch)  # embedding to logits in one call
            logits = logits if index is None else logits[index]
        else:
            input_ids, meta = pack_batch(batch, self.device)
            hidden = self.model(input_ids, meta, self.kv_cache.layers)
            logits = self.model.compute_logits(hidden if index is None else hidden[index]).float()
        for item in batch:
            item.seq.num_cached += item.num_tokens
        return logits
