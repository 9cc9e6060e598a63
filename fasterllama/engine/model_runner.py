"""ModelRunner: packs a step's tokens with no padding, runs the model (or the backend's whole-step
decode where it covers the step), returns the logits of the positions that sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..backends import Backend, DecodePlan
from ..model import LlamaForCausalLM
from ..parallel.group import TPGroup
from .kv_cache import KVCache
from .scheduler import ScheduledSeq
from .sequence import Sequence


@dataclass
class StepInputs:
    """A step's packed tokens and where each goes in the KV cache, as plain lists: what rank 0
    sends tensor-parallel workers (no activations) and what every rank turns into tensors."""

    tokens: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    start_positions: list[int]
    token_offsets: list[int]

    def to_tensors(self, device: torch.device) -> tuple[torch.Tensor, ops.AttentionMetadata]:
        meta = ops.AttentionMetadata(
            slot_mapping=torch.tensor(self.slot_mapping, dtype=torch.int64, device=device),
            positions=torch.tensor(self.positions, dtype=torch.int64, device=device),
            block_tables=ops.block_tables_tensor(self.block_tables, device),
            start_positions=self.start_positions,
            token_offsets=self.token_offsets,
        )
        return torch.tensor(self.tokens, dtype=torch.int64, device=device), meta


def step_inputs(batch: list[ScheduledSeq], block_size: int) -> StepInputs:
    """The step's new tokens of every sequence, packed, and where each goes in the KV cache. A
    sequence with drafts is given as one single-token sequence per token (each attending to the
    cache up to itself, its own and earlier tokens stored first): a verify step is then a decode
    step of more rows, which the decode kernels and the whole-step decode run as they are."""
    inputs = StepInputs([], [], [], [], [], [0])
    for item in batch:
        seq, n, bs = item.seq, item.num_tokens, block_size
        start, table = seq.num_cached, seq.block_table
        inputs.tokens += seq.token_ids(start, start + n - len(item.drafts)) + item.drafts
        inputs.positions += range(start, start + n)
        inputs.slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        for first in range(start, start + n) if item.drafts else (start,):
            inputs.block_tables.append(table)
            inputs.start_positions.append(first)
            inputs.token_offsets.append(inputs.token_offsets[-1] + (1 if item.drafts else n))
    return inputs


def decode_inputs(seqs: list[Sequence], positions: list[int], block_size: int) -> StepInputs:
    """One new token a sequence at the given positions, its id not yet on the host (a chained
    step's: LLMEngine); the ids are placeholders the step takes from the device instead."""
    slots = [seq.block_table[p // block_size] * block_size + p % block_size for seq, p in zip(seqs, positions)]
    return StepInputs([0] * len(seqs), list(positions), slots, [seq.block_table for seq in seqs], list(positions),
                      list(range(len(seqs) + 1)))


def pack_batch(batch: list[ScheduledSeq], block_size: int, device: torch.device) -> tuple[torch.Tensor, ops.AttentionMetadata]:
    """The step's packed token ids and attention metadata as tensors on `device`."""
    return step_inputs(batch, block_size).to_tensors(device)


class ModelRunner:
    """Runs the model for the scheduler's steps. Under tensor parallelism (`group`) every rank has
    one: rank 0's sends each step's inputs and KV block copies to the others, whose `run_worker`
    loop replays them on their shards; the model's collectives meet in between."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: Backend, max_num_seqs: int, max_model_len: int,
                 group: TPGroup | None = None, whole_step_decode: bool = True) -> None:
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len  # the whole-step decode's static shapes
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = backend.device
        self.group = group
        self.whole_step_decode = whole_step_decode and group is None  # the whole-step decodes have no collectives between layers
        self.in_step = False
        self.decode_plan: DecodePlan | None = None
        self.refresh_decode_plan()

    @property
    def max_verify_rows(self) -> int:
        """The most rows a speculative verify step should have: what the whole-step decode covers
        (past it a step falls back to the slower op-by-op path), else 64."""
        return self.decode_plan.max_rows if self.decode_plan is not None else 64

    def refresh_decode_plan(self) -> None:
        """(Re)prepare the weights for the backend's kernels (panels and huge pages on the CPU) and
        its whole-step decode; needed after modules change (quantization)."""
        self.decode_plan = None  # let go of the old tensors before they move
        self.backend.prepare_model(self.model)
        if self.whole_step_decode:
            self.decode_plan = self.backend.decode_plan(self.model, self.kv_cache, self.max_num_seqs, self.max_model_len)

    def execute(self, batch: list[ScheduledSeq], rows: list[int] | None = None) -> torch.Tensor:
        """Run one step; fp32 logits of the given packed-token rows (default: every row). The
        caller advances the sequences (Scheduler.advance)."""
        self.backend.begin_step()
        if self.decode_plan is not None and self.decode_plan.covers(batch):
            logits = self.decode_plan.run(batch, rows)  # embedding to logits in one call (a plan enters inference mode if it needs it)
            self.backend.after_forward(sum(item.num_tokens for item in batch))
            return logits
        inputs = step_inputs(batch, self.kv_cache.block_size)
        if self.group is None:
            return self._forward(inputs, rows)
        self.in_step = True  # stays True if the step is interrupted: the workers are then mid-step
        self.group.send(("step", inputs, rows))
        logits = self._forward(inputs, rows)
        self.in_step = False
        return logits

    def execute_chained(self, inputs: StepInputs, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A decode step (decode_inputs) whose input ids are rows `rows` of the last step's sampled
        `tokens`, left on the device: the host never waits for them before launching it. Not
        under tensor parallelism (the workers take their ids from rank 0's lists)."""
        self.backend.begin_step()
        plan = self.decode_plan
        if plan is not None and plan.chains and len(rows) <= plan.max_rows:
            logits = plan.run_chained(inputs, tokens, rows)
            self.backend.after_forward(len(rows))
            return logits
        return self._forward(inputs, None, tokens[torch.tensor(rows, dtype=torch.int64, device=tokens.device)])

    @torch.inference_mode()
    def _forward(self, inputs: StepInputs, rows: list[int] | None, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of `rows` (None on tensor-parallel ranks other than the first); input_ids
        in place of inputs.tokens where given."""
        ids, meta = inputs.to_tensors(self.device)
        input_ids = ids if input_ids is None else input_ids
        hidden = self.model(input_ids, meta, self.kv_cache.layers)
        if rows is not None:
            hidden = hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)]
        logits = self.model.compute_logits(hidden)
        self.backend.after_forward(input_ids.numel())
        return None if logits is None else logits.float()

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write of KV blocks, on every rank's cache."""
        if self.group is not None:
            self.group.send(("copy", src, dst))
        self.kv_cache.copy_blocks(src, dst)

    def stop_workers(self) -> bool:
        """Tell idle workers to stop; False where a step was cut short (Ctrl-C, a failure) and the
        workers wait inside it, to be ended instead."""
        if self.group is None or self.in_step:
            return False
        self.group.send(("stop",))
        return True

    @torch.inference_mode()
    def run_worker(self) -> None:
        """A tensor-parallel worker's life: rank 0's steps and copies until it says stop."""
        while True:
            command = self.group.receive()
            if command[0] == "step":
                self.backend.begin_step()
                self._forward(*command[1:])
            elif command[0] == "copy":
                self.kv_cache.copy_blocks(*command[1:])
            else:
                return
