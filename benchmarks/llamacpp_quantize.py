"""A GGUF file made by llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize), the
reference for `fasterllama quantize --mode q4_k_m` and for benchmarks/compare_cpu.py --model:

    python benchmarks/llamacpp_quantize.py OUT.gguf [--model SRC.gguf] [--type q4_k_m]

A quantized source (the default model's Q4_1 file) is requantized, as llama-quantize
--allow-requantize does. Needs the `llamacpp` extra (see compare_cpu.py)."""

from __future__ import annotations

import argparse
import ctypes
import os
import time

TYPES = {name: f"LLAMA_FTYPE_MOSTLY_{name.upper()}" for name in (
    "q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q3_k_m", "q3_k_l", "q2_k", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "iq4_nl", "iq4_xs")}


def main() -> None:
    import llama_cpp

    from fasterllama.loading.registry import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default=None, help="source GGUF (default: the default model's file)")
    ap.add_argument("--type", default="q4_k_m", choices=sorted(TYPES))
    args = ap.parse_args()
    src = resolve_model_path(args.model)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, TYPES[args.type])
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    t = time.perf_counter()
    if llama_cpp.llama_model_quantize(src.encode(), args.out.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {src}")
    print(f"wrote {args.out} ({args.type}, {os.path.getsize(args.out) / 1e6:.1f} MB) from {src} in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
