"""load_model: a checkpoint (path or known name) to a LlamaForCausalLM on a device, with its
config and tokenizer: float weights, a GGUF file's quantized tensors kept as they are, or a
checkpoint written by `fasterllama quantize`. Quantizing a float model is the engine's step after."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import FasterLlamaError
from ..host_memory import free_memory
from ..model import LlamaForCausalLM
from ..tokenizer import Tokenizer
from . import open_checkpoint


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: str | None
    quant_config: object  # None (float), "gguf" / "gguf-a8" (the file's blocks) or the QuantConfig


GGUF_NATIVE = ("gguf", "gguf-a8")  # quantization values that keep a GGUF file's blocks


def keeps_16bit_for(quantization: object) -> bool:
    """Whether a load for this quantization value may keep a checkpoint's 16-bit matrices (where
    the backend can): as the file is (None, gguf, gguf-a8), or for the weight-only modes, which
    widen one linear at a time as they quantize it (so a bf16 7B model quantizes without its fp32
    copy); not for "none" (fp32 asked for) or w8a8 (SmoothQuant scales whole layers in fp32)."""
    from ..quant.config import QuantConfig

    if quantization is None or quantization in GGUF_NATIVE or quantization == "none":
        return quantization != "none"
    return QuantConfig.parse(quantization).mode in ("w8", "w4")


def _counted(items, bar):
    for item in items:
        if bar is not None:
            bar.update(1)
        yield item


def load_model(model: str | None, dtype: torch.dtype, device: torch.device, quantization: str | None, keep_gguf_quantized: bool,
               progress: bool = True, shard: tuple[int, int] | None = None, keep_16bit: bool = False) -> LoadedModel:
    """quantization None: a GGUF file's quantized tensors stay quantized where
    `keep_gguf_quantized` (the backend's kernels run them exactly); "gguf" asks for that
    ("gguf-a8": and every product of those tensors takes x rounded to int8, as llama.cpp's do),
    "none" expands every tensor to `dtype`; any other mode loads floats for the caller to quantize.
    keep_16bit (the caller's choice: keeps_16bit_for): fp16 / bf16 matrices stay 16-bit in an fp32
    model (the backend's kernels widen them exactly).
    shard (rank, ranks): build and load only this tensor-parallel rank's part of the model, each
    tensor cut as it loads (parallel.sharding.ShardPlan), so a rank holds about 1/ranks of the
    weights; parallel.sharding.shard_model then puts the collectives between the parts."""
    from ..quant.checkpoint import load_quantized
    from ..quant.gguf_native import load_gguf_native
    from ..quant.linear import Int4Linear, Int8Linear, PackedLinear

    ckpt = open_checkpoint(model)
    plan = None
    if shard is not None:  # build only this rank's part, and fill it with the parts of the tensors
        from ..parallel.sharding import ShardPlan

        plan = ShardPlan.build(ckpt.config, *shard)
    saved_quant = getattr(ckpt.source, "quantization", None)
    requested = quantization
    if quantization is None:
        quantization = "gguf" if ckpt.format == "gguf" and keep_gguf_quantized and saved_quant is None else "none"
    keep_16bit = keep_16bit and dtype == torch.float32
    local_config = ckpt.config if plan is None else plan.local_model_config()
    _check_memory(ckpt, local_config, dtype, device, saved_quant is not None or quantization in GGUF_NATIVE, keep_16bit, 1 if plan is None else plan.size)
    net = LlamaForCausalLM(local_config)
    tensors = ckpt.iter_tensors() if plan is None else ((name, plan.cut_tensor(name, t)) for name, t in ckpt.iter_tensors())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(ckpt.tensor_names), desc="Loading model", unit="tensor", file=sys.stderr, leave=False,
                   disable=None)  # (None: only on a terminal; in a log or a pipe a bar is \r frames)
    quant_config = None
    try:
        if saved_quant is not None:  # written by `fasterllama quantize`: load as saved
            if requested is not None:
                raise FasterLlamaError("this checkpoint is quantized already: load it as it is (no --quantization), "
                                       "and quantize the float checkpoint it came from for another mode")
            if plan is not None:
                raise FasterLlamaError("tensor parallelism does not load checkpoints saved by `fasterllama quantize` yet: "
                                       "load the float or GGUF model with quantization=...")
            quant_config = load_quantized(net, saved_quant, _counted(ckpt.iter_tensors(), bar), dtype, device)
        elif quantization in GGUF_NATIVE:  # keep the file's quantized tensors quantized
            if ckpt.format != "gguf":
                raise FasterLlamaError(f"quantization {quantization!r} keeps a GGUF file's quantized tensors; this model is not a GGUF file")
            load_gguf_native(net, ckpt.source, dtype, device, bar, plan, keep_16bit)
            if quantization == "gguf-a8":
                for m in net.modules():
                    if isinstance(m, (PackedLinear, Int8Linear, Int4Linear)):
                        m.int8_activations = True
            quant_config = quantization
        else:
            net.load_weights(_counted(tensors, bar), dtype, device, keep_16bit=keep_16bit)
    finally:
        if bar is not None:
            bar.close()
    if plan is not None:
        net.config, net.tp_plan = ckpt.config, plan  # a whole model's config over its parts (parallel.sharding.shard_model)
    net.eval()
    return LoadedModel(net, ckpt.config, ckpt.tokenizer, ckpt.path, quant_config)


def _check_memory(ckpt, config: ModelConfig, dtype: torch.dtype, device: torch.device, kept_quantized: bool, kept_16bit: bool, ranks: int) -> None:
    """A model whose weights cannot fit fails now, saying what it needs, rather than minutes into
    the load at the OOM killer. Kept as stored (quantized, 16-bit), weights take their bytes in the
    file; otherwise every weight is a `dtype` float (the quantization modes quantize the loaded floats)."""
    need = config.num_parameters() * dtype.itemsize
    if kept_quantized and ckpt.format == "gguf":
        from ..quant.gguf_native import loaded_bytes

        need = loaded_bytes(ckpt.source, dtype, kept_16bit) // ranks
    elif kept_quantized or (kept_16bit and ckpt.format != "gguf"):  # (a GGUF file not loaded natively: expanded)
        shards = getattr(ckpt.source, "shards", None)  # (a HF folder's: only the files its index names)
        files = list(shards) if shards else [ckpt.path] if os.path.isfile(ckpt.path) else \
            [os.path.join(ckpt.path, f) for f in os.listdir(ckpt.path) if f.endswith(".safetensors")]
        stored = sum(os.path.getsize(f) for f in files) // ranks
        need = stored if kept_quantized else min(need, stored)  # (16-bit or `dtype` floats: at most the latter's bytes)
    free = free_memory(device, with_swap=True, unknown=None)
    if free is None or need <= free:  # (where the host does not say, the load goes ahead)
        return
    hint = ""
    # weights loaded as `dtype` floats: all of them unless kept quantized; kept 16-bit, a file of mostly fp32 ones
    if not kept_quantized and (not kept_16bit or need > 3 * config.num_parameters()):
        hint = f"; every weight loads as {str(dtype).removeprefix('torch.')} (quantization modes quantize after loading)"
        if dtype.itemsize > 2:
            hint += "; --dtype bfloat16 halves that"
        if ckpt.format == "gguf":
            hint += "; by default (no --quantization) a GGUF file's quantized tensors stay quantized" + (
                " and its F16 / BF16 ones 16-bit" if device.type == "cpu" else "")
    where = "GPU memory" if device.type == "cuda" else "memory (RAM and swap)"
    raise FasterLlamaError(f"{ckpt.path}: the weights need about {need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB of {where} is free{hint}")
