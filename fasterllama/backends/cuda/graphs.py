"""Decode steps replayed from CUDA graphs.

A decode step of a small model is ~300 kernel launches of a few microseconds each: launched
from Python one by one, the GPU idles between them. Captured once into a CUDA graph, the whole
step (embedding, every layer, final norm, lm_head) is one launch. Graphs replay fixed shapes and
fixed addresses, so each is captured for a bucket of batch sizes over static buffers: a step of
B sequences fills the smallest bucket >= B, the rows past B marked as padding (KV slot -1: no
store; context length 0: no attention). Block tables live in a static [bucket, max blocks a
sequence can have] buffer, so the attention kernel's launch shape never changes. A speculative
verify step is a decode step of more rows (a row per drafted token, model_runner.step_inputs). Captured lazily, the first time a bucket is needed, into
one shared memory pool. The inputs of a step travel in one copy from a pinned host buffer.

On a device without graphs (the kernels on CPU tensors under TRITON_INTERPRET=1, in tests) the
same buffers and padding run eagerly, so that logic is tested without a GPU."""

from __future__ import annotations

import torch

from ...engine.kv_cache import KVCache
from ...engine.model_runner import StepInputs, step_inputs
from ...engine.scheduler import ScheduledSeq
from ...model import LlamaForCausalLM
from ...ops import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_IDS, _POS, _SLOT, _LEN = range(4)  # rows of the input buffer


class CUDAGraphDecode:
    chains = True  # run_chained: the ids gathered on the device from the last step's samples

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, max_num_seqs: int, max_model_len: int) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.device = kv_cache.layers[0][0].device
        self.buckets = [b for b in BUCKETS if b <= max_num_seqs] or [1]
        if self.buckets[-1] < max_num_seqs <= BUCKETS[-1]:
            self.buckets.append(max_num_seqs)
        n = self.buckets[-1]
        width = -(-max_model_len // kv_cache.block_size)
        self.use_graphs = self.device.type == "cuda"
        self.inputs = torch.zeros(4, n, dtype=torch.int64, device=self.device)
        self.host = torch.zeros(4, n, dtype=torch.int64, pin_memory=self.use_graphs)
        self.host_rows = self.host.numpy()
        self.tables = torch.zeros(n, width, dtype=torch.int32, device=self.device)
        self.host_tables = torch.zeros(n, width, dtype=torch.int32, pin_memory=self.use_graphs)
        self.host_table_rows = self.host_tables.numpy()
        self.copied = torch.cuda.Event() if self.use_graphs else None  # the host buffer is refilled once its last copy ran
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | AttentionMetadata]] = {}
        self.pool = None

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def covers(self, batch: list[ScheduledSeq]) -> bool:
        """Steps of decoding sequences (one new token each, and any speculative drafts: a row per token)."""
        return sum(item.num_tokens for item in batch) <= self.max_rows and all(item.num_tokens == 1 + len(item.drafts) for item in batch)

    def _meta(self, n: int) -> AttentionMetadata:
        """Metadata whose tensors are views of the static input buffer (what the kernels read)."""
        meta = AttentionMetadata(
            slot_mapping=self.inputs[_SLOT, :n], positions=self.inputs[_POS, :n], block_tables=self.tables[:n],
            start_positions=[0] * n, token_offsets=list(range(n + 1)),
        )
        meta.decode_lengths = self.inputs[_LEN, :n]
        return meta

    def _forward(self, n: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.inputs[_IDS, :n], meta, self.kv_cache.layers)
        return self.model.compute_logits(hidden).float()

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | AttentionMetadata]:
        """(graph, its logits) for bucket n; without graphs (None, the bucket's metadata)."""
        self.inputs[:, :n] = 0
        self.inputs[_SLOT, :n] = -1  # warm-up and capture touch no cache row
        meta = self._meta(n)  # (built outside the capture: it copies small lists to the device)
        if not self.use_graphs:
            return None, meta
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():  # compiles the kernels, outside the graph
            self._forward(n, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            logits = self._forward(n, meta)
        self.pool = graph.pool()
        return graph, logits

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], rows: list[int] | None = None) -> torch.Tensor:
        logits = self._run(step_inputs(batch, self.kv_cache.block_size))  # one row per token, each with its block table
        return logits if rows is None else logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]

    @torch.inference_mode()
    def run_chained(self, inputs: StepInputs, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return self._run(inputs, (tokens, rows))

    def _run(self, step: StepInputs, source: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """source: the ids are those rows of a device tensor (the input buffer's id row carries the
        row numbers, then a gather on the device puts the ids in their place)."""
        B = len(step.tokens)
        n = next(b for b in self.buckets if b >= B)
        if n not in self.graphs:
            self.graphs[n] = self._capture(n)
        graph, out = self.graphs[n]
        if self.copied is not None:
            self.copied.synchronize()
        rows, tables = self.host_rows, self.host_table_rows
        rows[_IDS, :B] = step.tokens if source is None else source[1]
        rows[_POS, :B] = step.positions
        rows[_SLOT, :B] = step.slot_mapping
        rows[_LEN, :B] = [p + 1 for p in step.start_positions]
        rows[:, B:n] = 0
        rows[_SLOT, B:n] = -1
        width = max(len(t) for t in step.block_tables)  # columns past it: unread (beyond every length)
        for i, table in enumerate(step.block_tables):
            tables[i, : len(table)] = table
        tables[B:n, :width] = 0
        # contiguous on both sides, so the copies go straight from pinned memory: torch copies a
        # strided slice through a pageable temporary, and from pageable memory CUDA waits for the
        # stream (the last step) before it copies, which would undo chained steps' overlap
        self.inputs.copy_(self.host, non_blocking=True)  # (every bucket's columns: 4 x 256 ids at most)
        self.tables[:n].copy_(self.host_tables[:n], non_blocking=True)  # (whole rows: columns past width unread)
        if source is not None:
            ids = self.inputs[_IDS, :B]
            ids.copy_(source[0].index_select(0, ids))
        if graph is None:
            return self._forward(n, out)[:B]
        self.copied.record()
        graph.replay()
        return out[:B]
