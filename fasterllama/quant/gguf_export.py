"""Write a GGUF file of llama.cpp's quantization mixes (`fasterllama quantize SRC --mode q4_k_m -o
OUT.gguf`) without llama.cpp: every 2-D weight of the source GGUF is dequantized (gguf-py) and
quantized again by kquants with the type llama.cpp's rule gives that tensor (kquants.tensor_type:
for q4_k_m Q6_K for the output matrix and the use_more_bits layers' attn_v / ffn_down, Q4_K
elsewhere, Q5_0 / Q8_0 where rows are not whole 256-element super-blocks; for iq4_xs IQ4_XS with
IQ4_NL where rows are not whole super-blocks, Q6_K output, Q5_K for the first eighth's ffn_down). Metadata, norms and
other 1-D tensors are copied as they are. Block quantization works along rows, so llama.cpp's
Q/K row permutation in the source carries over unchanged. A quantized source is requantized from
its own values (as llama.cpp's --allow-requantize does)."""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from ..errors import FasterLlamaError
from ..loading.gguf_reader import GGUFFile
from . import kquants

# mode -> GGUF file type
FILE_TYPES = {"q4_k_m": "MOSTLY_Q4_K_M", "q4_k": "MOSTLY_Q4_K_S", "q5_k": "MOSTLY_Q5_K_S", "q6_k": "MOSTLY_Q6_K", "q2_k": "MOSTLY_Q2_K",
              "q8_0": "MOSTLY_Q8_0", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1",
              "iq4_nl": "MOSTLY_IQ4_NL", "iq4_xs": "MOSTLY_IQ4_XS"}
MODES = tuple(FILE_TYPES)


def requantize(src: str, dst: str, mode: str, progress: Callable[[int], None] | None = None) -> collections.Counter:
    """Write `dst` from the GGUF file `src` with every 2-D weight in `mode`'s per-tensor type;
    returns how many tensors got each type. progress(1) after each tensor."""
    import gguf
    import torch

    from ..backends import get_backend

    if mode not in FILE_TYPES:
        raise FasterLlamaError(f"unknown GGUF mode {mode!r} (known: {', '.join(MODES)})")
    get_backend(torch.device("cpu")).register_ops()  # the C kernels' scale search, where they build
    reader = GGUFFile(src)  # (gguf-py's GGUFReader takes seconds over a vocabulary's metadata)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    skip = {gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE}
    for field in reader.fields.values():  # the metadata as it is, but the file type
        if field.name in skip or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.ALIGNMENT:  # (the writer pads the data to it: the key alone would misplace every tensor)
            writer.add_custom_alignment(int(field.contents()))
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[mode]))
    tied = "output.weight" not in {t.name for t in reader.tensors}
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    heads, kv_heads = (reader.fields.get(f"{arch}.attention.{k}") for k in ("head_count", "head_count_kv"))
    n_gqa = int(heads.contents()) // int(kv_heads.contents()) if heads is not None and kv_heads is not None else 1
    counts: collections.Counter = collections.Counter()
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # [rows, K]
        if len(shape) != 2 or t.name.endswith("norm.weight"):
            data, qtype = t.data, t.tensor_type
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            type_name = kquants.export_tensor_type(t.name, shape[1], mode, n_layers, tied, n_gqa)
            qtype = gguf.GGMLQuantizationType[type_name.upper()]
            data = w.astype(np.float16) if type_name == "f16" else kquants.quantize(w, type_name)
        counts[qtype.name] += 1
        native = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        writer.add_tensor(t.name, data, raw_dtype=None if native else qtype)
        if progress is not None:
            progress(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts
