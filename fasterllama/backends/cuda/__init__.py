"""The CUDA backend: Triton kernels for every op of the decode step (row-wise norms and SiLU,
RoPE + KV store, decode and prefill attention, GEMV/GEMMs over weights kept quantized, the
W8A8 GEMM), bf16 by default, and decode steps replayed from CUDA graphs (graphs.py).

Without Triton (or with FASTERLLAMA_NO_TRITON=1) the PyTorch reference ops run, eagerly."""

from __future__ import annotations

import logging
import os

import torch

from ... import ops
from .. import Backend, DecodePlan

log = logging.getLogger(__name__)


def kernel_ops() -> dict | None:
    """The Triton versions of the op layer's ops, or None where Triton is missing or turned off."""
    if os.environ.get("FASTERLLAMA_NO_TRITON") == "1":
        return None
    try:
        from . import triton_attention, triton_linear, triton_norm
    except ImportError as e:  # triton not installed: the reference ops still run
        log.warning("Triton unavailable (%s): CUDA runs the PyTorch reference ops", e)
        return None
    return {
        **triton_norm.OPS,
        "rope_and_store_kv": triton_attention.rope_and_store_kv,
        "attention": triton_attention.attention,
        "int8_weight_linear": triton_linear.int8_weight_linear,
        "int4_weight_linear": triton_linear.int4_weight_linear,
        "int8_linear": triton_linear.int8_gemm_dequant,
    }


class CUDABackend(Backend):
    default_dtype = torch.bfloat16

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.kernels = False

    def register_ops(self) -> None:
        table = kernel_ops()
        for name, fn in (table or {}).items():
            ops.register("cuda", name, fn)
        self.kernels = table is not None

    def keeps_gguf_quantized(self, dtype: torch.dtype) -> bool:
        return self.kernels  # GEMV/GEMM kernels read Q8_0 / Q4_0 / Q4_1 blocks as they are

    def decode_plan(self, model, kv_cache) -> DecodePlan | None:
        """CUDA graphs need every op of the step to be a kernel that reads its inputs from device
        tensors (the reference ops slice by Python lengths): only with the kernels registered."""
        if not self.kernels or os.environ.get("FASTERLLAMA_NO_CUDA_GRAPHS") == "1":
            return None
        from .graphs import CUDAGraphDecode
        from .triton_attention import supports

        if not supports(model.config.head_dim):
            return None

        return CUDAGraphDecode(model, kv_cache)
