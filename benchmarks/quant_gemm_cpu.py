"""The prefill GEMM on quantized panels (fl_panel_gemm: no float copy of the weights) against
oneDNN's fp32 sgemm on the same weights already dequantized (what the float path runs, without the
cost of making the float copy), and the GEMM of quantization "gguf-a8" (fl_panel_gemm_a8: x rounded
to int8, integer dot products), at SmolLM2-135M's shapes, weights hot in cache. All alternate call
by call; best of --repeats each. Prints GFLOP/s (a multiply-add: 2) and the ratios.

    python benchmarks/quant_gemm_cpu.py [--rows 32,128,512,2048] [--repeats 8]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from fasterllama.backends.cpu import kernels as ck
from fasterllama.quant.linear import PackedLinear

# (name, N, K, bits, group): the Q4_K_M file's types at the model's shapes
SHAPES = [("qkv Q8_0", 960, 576, 8, 32), ("gate_up Q5_0", 3072, 576, 5, 32), ("down Q4_K", 576, 1536, 4, 32), ("down Q6_K", 576, 1536, 6, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="32,128,512,2048")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    if ck.load() is None:
        raise SystemExit("the C kernels cannot be built here")
    torch.manual_seed(0)
    print("| matrix | rows | panel GEMM GFLOP/s | oneDNN sgemm on floats GFLOP/s | panel / sgemm | a8 GEMM GFLOP/s | a8 / panel |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, n, k, bits, g in SHAPES:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8) if bits == 8 else torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
        scales = (torch.rand(n, k // g) * 0.01).half().float()
        mins = None if bits in (5, 6, 8) else (-torch.rand(n, k // g) * 0.01).half().float()
        lin = PackedLinear(q, scales, mins, bits)
        w = lin.dequantize()
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            args_ = (x, lin.qweight, lin.scales, lin.mins, n, bits)
            fns = {"gemm": partial(ck.panel_linear, *args_), "sgemm": partial(ck.sgemm, x, w), "a8": partial(ck.panel_linear_a8, *args_)}
            best = dict.fromkeys(fns, float("inf"))
            for fn in fns.values():
                fn()
            for _ in range(args.repeats):
                for key, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    best[key] = min(best[key], time.perf_counter() - t0)
            flops = 2 * m * n * k / 1e9
            print(f"| {name} {n}x{k} | {m} | {flops / best['gemm']:.1f} | {flops / best['sgemm']:.1f} | {best['sgemm'] / best['gemm']:.2f} "
                  f"| {flops / best['a8']:.1f} | {best['gemm'] / best['a8']:.2f} |")


if __name__ == "__main__":
    main()
