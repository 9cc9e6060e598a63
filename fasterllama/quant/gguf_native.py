"""Load a GGUF file keeping its quantized tensors quantized: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
K-quants Q2_K .. Q6_K are read as integer values with a scale and a min per group
(gguf_blocks.py) and repacked exactly into the CPU kernels' panels (PackedLinear), so weight memory
stays near the file size and the kernels compute with exactly the floats gguf's dequantizers give.
Fused projections whose parts have different types (a _K_M file's q/k in Q5_0 and v in Q8_0) take
the narrowest form that holds every part exactly (gguf_blocks.combine). Other tensors (norms,
F16/BF16/F32 weights, types without a decoder) are expanded to float."""

from __future__ import annotations

import numpy as np
import torch

from ..host_memory import release_freed_memory
from ..loading.gguf_file import GGUFCheckpoint, _dequantize, canonical_name, stored_16bit, unpermute_rope_rows
from ..model.llama import LlamaForCausalLM
from ..parallel.sharding import ShardPlan, cut_module
from . import gguf_blocks
from .linear import FusedLinear, Int4Linear, Int8Linear, PackedLinear, QuantizedEmbedding

NATIVE_TYPES = tuple(gguf_blocks.FORMATS)
TRIM_BYTES = 16 << 20  # decoded blocks between heap trims: each tensor's temporaries are freed, not returned
# fused parameter -> its canonical parts, in row order
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _form(b: gguf_blocks.Blocks) -> tuple:
    return b.bits, b.group, b.mins is None, b.factors is None


def _packed(b: gguf_blocks.Blocks) -> PackedLinear:
    f = b.factors  # a K-quant's compact scales: int8 times fp16 per super-block
    if f is not None:
        return PackedLinear(torch.from_numpy(b.q), torch.from_numpy(f.scale_sub), None if f.min_sub is None else torch.from_numpy(f.min_sub), b.bits,
                            scale_super=torch.from_numpy(f.scale_super), min_super=None if f.min_super is None else torch.from_numpy(f.min_super))
    return PackedLinear(torch.from_numpy(b.q), torch.from_numpy(b.scale), None if b.mins is None else torch.from_numpy(b.mins), b.bits)


def _module(parts: list[gguf_blocks.Blocks], device: torch.device) -> torch.nn.Module | None:
    """The quantized module for a (fused) projection's parts: on the CPU a PackedLinear, or where the
    parts' forms differ a FusedLinear of one per run of alike parts (each in its own width); on other
    devices the row layouts their kernels read: 4-bit values with a scale and min per group of 32
    or more (Q4_0, Q4_1: fp16; Q4_K: its factored int8 x fp16 form), int8 for other values (Q5_0,
    Q8_0, Q3_K's and Q6_K's groups of 16, IQ4's table values; with fp32 mins, Q5_1's and Q5_K's
    values 0..31 and Q2_K's 0..3 in groups of 16). None where those cannot hold the parts exactly
    (groups that are not a power of two of at least 16: loaded as float)."""
    if device.type == "cpu":
        runs: list[list[gguf_blocks.Blocks]] = []
        for b in parts:
            if runs and _form(runs[-1][0]) == _form(b):
                runs[-1].append(b)
            else:
                runs.append([b])
        modules = [_packed(gguf_blocks.combine(run)) for run in runs]
        return modules[0] if len(modules) == 1 else FusedLinear(modules)
    b = gguf_blocks.combine(parts)
    scale = torch.from_numpy(b.scale)
    if b.group < 16 or b.group & (b.group - 1):
        return None
    if b.bits == 4 and b.group >= 32:
        f = b.factors
        if f is not None and f.min_sub is not None:  # Q4_K: its own compact scales and mins, 4.5 bits a weight (not 6)
            return Int4Linear(torch.from_numpy(b.q), torch.from_numpy(f.scale_sub), torch.from_numpy(f.min_sub),
                              scale_super=torch.from_numpy(f.scale_super), min_super=torch.from_numpy(f.min_super))
        mins = torch.from_numpy(b.explicit_mins())
        exact16 = all(torch.equal(x.half().float(), x) for x in (scale, mins))
        return Int4Linear(torch.from_numpy(b.q), scale, mins, scale_dtype=torch.float16 if exact16 else torch.float32)
    if b.mins is None:
        q = gguf_blocks.NL4_VALUES[b.q] if b.bits == gguf_blocks.NL4 else (b.q.astype(np.int16) - b.centre).astype(np.int8)
        return Int8Linear(torch.from_numpy(q), scale)
    if b.bits != gguf_blocks.NL4:  # values 0 .. 2^bits - 1, or int8 (a Q8_0 part beside ones with mins)
        return Int8Linear(torch.from_numpy(b.q.astype(np.int8)), scale, mins=torch.from_numpy(b.mins))
    return None


def _take_bias(loaded: torch.nn.Module, quantized: torch.nn.Module) -> None:
    """Give the quantized layer the bias load_weights put in the float layer it replaces (a file's
    `.bias` tensors; a fused projection's parts each take their rows)."""
    bias = getattr(loaded, "bias", None)
    if bias is None:
        return
    parts = list(quantized.parts) if isinstance(quantized, FusedLinear) else [quantized]
    for part, rows in zip(parts, bias.data.split([p.out_features for p in parts])):
        part.bias = torch.nn.Parameter(rows.clone(), requires_grad=False)


def _kept_in_blocks(name: str, type_name: str) -> bool:
    """Whether load_gguf_native keeps this tensor in its file's blocks (a projection, the embedding
    or the head, in a type with a decoder); the rest load as float."""
    is_linear = name.endswith(".weight") and ("_proj." in name or name.startswith(("lm_head", "model.embed_tokens")))
    return is_linear and type_name in NATIVE_TYPES


def loaded_bytes(ckpt: GGUFCheckpoint, dtype: torch.dtype, keep_16bit: bool) -> int:
    """About what load_gguf_native's weights take: tensors kept in blocks or 16-bit, their bytes in
    the file; the others expanded to `dtype`."""
    total = 0
    for t in ckpt.reader.tensors:
        name = canonical_name(t.name)
        if name is None:
            continue
        as_stored = _kept_in_blocks(name, t.tensor_type.name) or (keep_16bit and t.tensor_type.name in ("F16", "BF16") and len(t.shape) == 2)
        total += int(t.n_bytes) if as_stored else int(t.n_elements) * dtype.itemsize
    return total


def load_gguf_native(model: LlamaForCausalLM, ckpt: GGUFCheckpoint, dtype: torch.dtype, device: torch.device, progress=None,
                     plan: ShardPlan | None = None, keep_16bit: bool = False) -> None:
    """plan: `model` holds one tensor-parallel rank's part; each tensor is cut to it as it loads,
    before it goes to the device. keep_16bit: F16 / BF16 matrices stay 16-bit (LlamaForCausalLM.load_weights)."""
    cfg = model.config if plan is None else plan.cfg  # the whole model's heads: the file holds whole tensors
    quantized: dict[str, torch.nn.Module] = {}
    float_names: set[str] = set()

    def floats():
        """The float tensors, one at a time as load_weights takes them (never all at once: an F16
        file's would be the model twice over), building the quantized modules on the way."""
        pending: dict[str, dict[str, gguf_blocks.Blocks]] = {}  # fused projections waiting for their other parts
        untrimmed = 0  # bytes read since the heap was last trimmed
        for t in ckpt.reader.tensors:
            name = canonical_name(t.name)
            if name is None:
                continue
            if progress is not None:
                progress.update(1)
            if untrimmed >= TRIM_BYTES:  # each tensor's temporaries (decoded blocks, float copies) would pile up on top of the weights
                release_freed_memory()
                untrimmed = 0
            untrimmed += t.n_bytes
            type_name = t.tensor_type.name
            if not _kept_in_blocks(name, type_name):
                shape = tuple(int(d) for d in reversed(t.shape))
                kept = stored_16bit(t.data, t.tensor_type) if keep_16bit and len(shape) == 2 else None
                arr = kept.reshape(shape) if kept is not None else torch.from_numpy(_dequantize(t.data, t.tensor_type).reshape(shape))
                if name.endswith(("q_proj.weight", "q_proj.bias")):
                    arr = unpermute_rope_rows(arr, cfg.num_heads)
                elif name.endswith(("k_proj.weight", "k_proj.bias")):
                    arr = unpermute_rope_rows(arr, cfg.num_kv_heads)
                ckpt.release_pages(t.data_offset, t.n_bytes)
                float_names.add(name)
                yield name, arr if plan is None else plan.cut_tensor(name, arr)
                continue
            rows = int(t.shape[1])
            blocks = gguf_blocks.decode(t.data, type_name, rows)
            if ".q_proj." in name or ".k_proj." in name:  # undo llama.cpp's row permutation, exactly
                heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
                blocks.map_rows(lambda a, h=heads: unpermute_rope_rows(a, h))
            ckpt.release_pages(t.data_offset, t.n_bytes)
            fused = next((f for f, ps in _PARTS.items() if any(f".{p}." in name for p in ps)), None)
            target, src = name, ""
            if fused is not None:
                src = next(p for p in _PARTS[fused] if f".{p}." in name)
                target = name.replace(f".{src}.", f".{fused}.")
            pending.setdefault(target, {})[src] = blocks
            order = _PARTS[fused] if fused else ("",)
            if all(p in pending[target] for p in order):  # complete: build it now, free the arrays
                parts = pending.pop(target)
                module = _module([parts[p] for p in order], device)
                if module is not None:
                    if plan is not None:
                        module = cut_module(plan, target.removeprefix("model.").removesuffix(".weight"), module)
                    quantized[target] = module.to(device)
                else:
                    pending[target] = parts  # expanded to float below
                del parts, module
        for target, parts in pending.items():  # fused projections with float parts, or no exact module: float
            fused = next((f for f in _PARTS if f".{f}." in target), None)
            for p, blocks in parts.items():
                name = target.replace(f".{fused}.", f".{p}.") if fused else target
                float_names.add(name)
                yield name, torch.from_numpy(blocks.values()) if plan is None else plan.cut_tensor(name, torch.from_numpy(blocks.values()))
        ckpt.release_all_pages()

    model.load_weights(floats(), dtype, device, skip=quantized, keep_16bit=keep_16bit)  # (skip: read once the tensors are in)
    for target, module in quantized.items():
        path = target.removeprefix("model.").removesuffix(".weight")
        if path == "embed_tokens":
            model.embed_tokens = QuantizedEmbedding(module, dtype)
        else:
            parent, _, attr = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            _take_bias(getattr(owner, attr), module)
            setattr(owner, attr, module)
    if "model.embed_tokens.weight" in quantized and "lm_head.weight" not in quantized and "lm_head.weight" not in float_names:
        model.lm_head = model.embed_tokens.table  # tied: one quantized matrix serves both
