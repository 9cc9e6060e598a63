"""One backend object per device type. A backend registers its ops with the op layer, says its
default dtype and how a GGUF file's quantized tensors load, prepares a loaded model for its
kernels, and offers a whole-step decode that the model runner uses where it covers the step.
The model and the decode path have no device branches; a few remain elsewhere, for memory and
layouts: the KV cache's default budget, freeing CUDA's cache, loading's memory check, GGUF and
quantization layouts, the reference int8 GEMM's padding for cuBLASLt."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..engine.kv_cache import KVCache
    from ..engine.model_runner import StepInputs
    from ..engine.scheduler import ScheduledSeq
    from ..model import LlamaForCausalLM


class DecodePlan(Protocol):
    """A decode step in one call (the C step on the CPU, a CUDA graph replay on the GPU)."""

    max_rows: int  # the most token rows a step it covers may have (decoding sequences and their drafts)
    chains: bool  # whether it runs chained steps (run_chained)

    def covers(self, batch: list[ScheduledSeq]) -> bool: ...

    def run(self, batch: list[ScheduledSeq], rows: list[int] | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab] of each sequence's new token (and drafts), or of the given
        packed rows only; advances nothing. Called outside inference mode: a plan whose torch ops
        need it enters it (the CPU's C step makes one tensor, and entering costs ~50 us a step)."""
        ...

    def run_chained(self, inputs: StepInputs, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits of a decode step (one token a row, at most max_rows) whose input ids are
        rows `rows` of the last step's sampled `tokens`, still on the device (LLMEngine: chained steps)."""
        ...


class Backend:
    """The base: the PyTorch reference ops, no preparation, no whole-step decode."""

    default_dtype = torch.float32
    kv_block_size = 16  # tokens a KV cache block holds by default (the granularity of sharing and prefix caching)
    # whether the engine launches a decode step before reading the last one's tokens: it pays where
    # kernels run queued behind the host (a GPU), which then prepares step n+1 while step n runs
    chains_steps = False
    decode_plan_is_graph = False  # its whole-step decode replays captured CUDA graphs (vLLM's enforce_eager turns them off)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def register_ops(self) -> None:
        """Register this backend's kernels with the op layer (ops.register)."""

    def keeps_gguf_quantized(self, dtype: torch.dtype) -> bool:
        """Whether a GGUF file's quantized tensors load quantized by default at this dtype."""
        return False

    def keeps_16bit_weights(self, dtype: torch.dtype) -> bool:
        """Whether a checkpoint's fp16 / bf16 matrices load as stored by default in a model of this
        dtype (its kernels widen them as they compute)."""
        return False

    def prepare_model(self, model: LlamaForCausalLM) -> None:
        """Put the loaded (and quantized) model's weights in the layouts the kernels read."""

    def decode_plan(self, model: LlamaForCausalLM, kv_cache: KVCache, max_num_seqs: int, max_model_len: int) -> DecodePlan | None:
        return None

    def tokens_later(self, tokens: torch.Tensor) -> Callable[[], list[int]]:
        """Start moving a step's sampled token ids to the host; the call returned waits for them.
        Here they are read at once."""
        values = tokens.tolist()
        return lambda: values

    def begin_step(self) -> None:
        """Called by the model runner before each step, in the thread that runs it."""

    def after_forward(self, num_tokens: int) -> None:
        """Called by the model runner after a step's model forward (not the whole-step decode)."""


def get_backend(device: torch.device) -> Backend:
    if device.type == "cpu":
        from .cpu import CPUBackend

        return CPUBackend(device)
    if device.type == "cuda":
        from .cuda import CUDABackend

        return CUDABackend(device)
    return Backend(device)
