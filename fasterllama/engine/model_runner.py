"""ModelRunner: packs a step's tokens with no padding, runs the model, returns the logits of the
positions that sample."""

from __future__ import annotations

import torch

from .. import ops
from ..model import LlamaForCausalLM
from ..ops import cpu_kernels
from ..quant.linear import use_cpu_panels
from . import huge_pages
from .cpu_decode_plan import CPUDecodePlan
from .kv_cache import KVCache
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.decode_plan: CPUDecodePlan | None = None
        self.refresh_decode_plan()

    def refresh_decode_plan(self) -> None:
        """(Re)collect the weights for the one-call CPU decode step; needed after modules change.
        On the CPU quantized weights first take the kernels' panel layout, and all weights move into
        2 MB pages (huge_pages.py), once per set of tensors."""
        self.decode_plan = None  # let go of the old tensors before they move
        if self.device.type == "cpu":
            if cpu_kernels.load() is not None:  # the C kernels read quantized weights in panels
                use_cpu_panels(self.model)
            huge_pages.pack_weights(self.model)
            self.decode_plan = CPUDecodePlan.build(self.model, self.kv_cache.layers)

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, ops.AttentionMetadata]:
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
        dev = self.device
        meta = ops.AttentionMetadata(
            slot_of_token=torch.tensor(slot_of_token, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slots=[item.seq.slot for item in batch],
            start_positions=[item.seq.num_cached for item in batch],
            token_offsets=offsets,
        )
        return torch.tensor(tokens, dtype=torch.int64, device=dev), meta

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], rows: list[int] | None = None) -> torch.Tensor:
        """Run one step; fp32 logits of the given packed-token rows (default: every row)."""
        input_ids, meta = self.prepare(batch)
        index = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=self.device)
        if self.decode_plan is not None and self.decode_plan.covers(meta):
            logits = self.decode_plan.forward(input_ids, meta)  # embedding to logits in one C call
            logits = logits if index is None else logits[index]
        else:
            hidden = self.model(input_ids, meta, self.kv_cache.layers)
            logits = self.model.compute_logits(hidden if index is None else hidden[index]).float()
        for item in batch:
            item.seq.num_cached += item.num_tokens
        return logits
