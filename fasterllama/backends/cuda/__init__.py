"""The CUDA backend: Triton kernels for every op of the decode step (row-wise norms and SiLU,
RoPE + KV store, decode and prefill attention, GEMV/GEMMs over weights kept quantized, the
W8A8 GEMM) and for sampling (two launches a step), bf16 by default, and decode steps replayed
from CUDA graphs (graphs.py).

Without Triton (or with FASTERLLAMA_NO_TRITON=1) the PyTorch reference ops run, eagerly."""

from __future__ import annotations

import logging
import os

import torch

from ... import ops
from .. import Backend, DecodePlan

log = logging.getLogger(__name__)


def _gemv_ops(gemv, triton_linear) -> dict:
    """The linears' ops: the decode GEMVs for 1-2 activation rows where the device's timing chose
    them (gemv.tune), cuBLAS (float) or the tiled kernels otherwise (under "gguf-a8" the integer
    GEMVs of gemv_a8.py, or x rounded to int8 before the others); and the down projection's
    GEMV making SiLU·mul itself, the qkv and gate_up GEMVs making the norm before them, where that
    was faster (None otherwise: the op layer composes)."""
    import torch.nn.functional as F

    def first(chosen, fallback):
        """The op: the chosen kernel's result, or where it returns None the fallback's."""

        def op(*args, **kwargs):
            out = chosen(*args, **kwargs)
            return out if out is not None else fallback(*args, **kwargs)

        return op

    linear = first(gemv.chosen_float, F.linear)
    int8_weight_linear = first(gemv.chosen_int8, triton_linear.int8_weight_linear)
    int4_weight_linear = first(gemv.chosen_int4, triton_linear.int4_weight_linear)
    int8_weight_linear_a8 = first(gemv.chosen_int8_a8, gemv.rounded_int8)
    int4_weight_linear_a8 = first(gemv.chosen_int4_a8, gemv.rounded_int4)
    return {"linear": linear, "int8_weight_linear": int8_weight_linear, "int4_weight_linear": int4_weight_linear,
            "int8_weight_linear_a8": int8_weight_linear_a8, "int4_weight_linear_a8": int4_weight_linear_a8,
            "silu_and_mul_linear": gemv.silu_and_mul_linear, "rms_norm_linear": gemv.rms_norm_linear}


def kernel_ops() -> dict | None:
    """The Triton versions of the op layer's ops, or None where Triton is missing or turned off."""
    if os.environ.get("FASTERLLAMA_NO_TRITON") == "1":
        return None
    try:
        from . import gemv, triton_attention, triton_linear, triton_norm, triton_sampling
    except ImportError as e:  # triton not installed: the reference ops still run
        log.warning("Triton unavailable (%s): CUDA runs the PyTorch reference ops", e)
        return None
    return {
        **triton_norm.OPS,
        "rope_tables": triton_attention.rope_tables,
        "rope_and_store_kv": triton_attention.rope_and_store_kv,
        "attention": triton_attention.attention,
        "rope_store_attention": triton_attention.rope_store_attention,
        **_gemv_ops(gemv, triton_linear),
        "int8_linear": triton_linear.int8_gemm_dequant,
        "sample_rows": triton_sampling.sample_rows,
    }


def compact_scales(model: torch.nn.Module) -> int:
    """Fewer bytes a weight for a decode step's GEMVs to read, the values unchanged: the int8
    linears' group scales (and mins) in fp16 where every one is an fp16 value (a GGUF Q8_0's,
    w8-g32's: quantize_int8 rounds them so), 8.5 bits a weight instead of 9; and no mins for the
    4-bit linears whose every min is -8 * scale (Q4_0's symmetric groups: the kernels compute
    them), 4.5 bits instead of 5. A K-quant's factored scales and mins (Q4_K's) are laid out in
    pairs, each group's scale and min side by side and each super-block's d and -dmin: one load
    each in the kernels. The kernels read either form; the CPU's read fp32 scales and mins, so
    only here. Returns how many linears changed."""
    from ...quant.linear import Int4Linear, Int8Linear

    changed = 0
    for m in model.modules():
        if isinstance(m, Int8Linear) and m.group_size is not None and not m.panels:
            fields = ["weight_scale"] + (["weight_min"] if m.weight_min is not None else [])
            ts = [getattr(m, f) for f in fields]
            if all(t.dtype == torch.float32 and torch.equal(t.half().float(), t) for t in ts):
                for f, t in zip(fields, ts):
                    setattr(m, f, torch.nn.Parameter(t.half(), requires_grad=False))
                changed += 1
        elif isinstance(m, Int4Linear) and not m.panels and m.sups is not None:
            for a, b in ((m.scales, m.mins), (m.scale_super, m.min_super)):
                a.data, b.data = ops.quantized.interleave(a.data, b.data)
            changed += 1
        elif isinstance(m, Int4Linear) and not m.panels and m.mins is not None and torch.equal(m.mins, ops.quantized.symmetric_mins(m.scales)):
            m.mins = None
            changed += 1
    return changed


class CUDABackend(Backend):
    default_dtype = torch.bfloat16
    chains_steps = True
    decode_plan_is_graph = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.kernels = False
        self.gemv_timings: dict = {}  # what prepare_model measured: {linear shape: {kernel: ms}}

    def register_ops(self) -> None:
        table = kernel_ops()
        for name, fn in (table or {}).items():
            ops.register("cuda", name, fn)
        self.kernels = table is not None

    def keeps_gguf_quantized(self, dtype: torch.dtype) -> bool:
        return self.kernels  # GEMV/GEMM kernels read every type the CPU keeps (gguf_native._module: 4-bit or int8 row layouts)

    def prepare_model(self, model) -> None:
        """Weights stay in the layouts they load in (less their redundant bytes: compact_scales); the
        decode GEMV of each linear shape, and the W8A8 prefill GEMM's tiles, are chosen by timing
        the candidates on this device (gemv.tune, triton_linear.tune_prefill)."""
        if self.kernels and self.device.type == "cuda":
            from . import gemv, triton_linear

            compact_scales(model)

            try:
                self.gemv_timings = {**gemv.tune(model, model.norm.weight.dtype), **triton_linear.tune_prefill(model)}
            except RuntimeError as e:  # an optimization only: the default kernels stay
                log.warning("timing the decode GEMVs / W8A8 prefill tiles failed (%s); using the defaults", e)

    def tokens_later(self, tokens: torch.Tensor):
        """A copy into pinned memory queued behind the step, and an event to wait on: reading the
        tokens directly would also wait for any step launched after them."""
        if not tokens.is_cuda:  # (the kernels on CPU tensors, interpreted)
            return super().tokens_later(tokens)
        host = tokens.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def read() -> list[int]:
            copied.synchronize()
            return host.tolist()

        return read

    def decode_plan(self, model, kv_cache, max_num_seqs: int, max_model_len: int) -> DecodePlan | None:
        """CUDA graphs need every op of the step to be a kernel that reads its inputs from device
        tensors (the reference ops slice by Python lengths): only with the kernels registered."""
        if not self.kernels or os.environ.get("FASTERLLAMA_NO_CUDA_GRAPHS") == "1":
            return None
        from .graphs import CUDAGraphDecode
        from .triton_attention import supports

        if not supports(model.config.head_dim):
            return None

        return CUDAGraphDecode(model, kv_cache, max_num_seqs, max_model_len)
