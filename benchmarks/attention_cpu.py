"""Decode attention alone: one step's attention over 30 layers' KV caches at SmolLM2's shapes (9
query heads, 3 KV heads, head dim 64), for libraries built from one or more kernel sources,
alternating. "cold" gives each layer its own cache, as a decode step finds them (the weights
streamed in between have pushed them out of the caches); "hot" reuses one layer's cache. Reports
milliseconds a step and the KV read rate, and checks every library's output against the first's.

    python benchmarks/attention_cpu.py [--batch 8] [--context 166] [--block-size 16] [--layout block-major]
                                       [--interleave] [old.c] [new.c]

--layout: the engine's head-major cache (each head's blocks one after another) or block-major (a
block's heads side by side); --interleave: the sequences' blocks alternate (as decoding several
sequences allocates them) instead of each sequence's blocks being consecutive.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fasterllama.backends.cpu import kernels as cpu_kernels

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="*", type=Path, default=[cpu_kernels.SOURCE])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=166, help="cached tokens per sequence")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--block-size", type=int, default=128, help="KV cache block size (rows)")
    ap.add_argument("--layout", choices=["head-major", "block-major"], default="head-major")
    ap.add_argument("--interleave", action="store_true", help="sequences' blocks alternate")
    args = ap.parse_args()
    B, L = args.batch, args.context
    bs = args.block_size
    nb = -(-(L + 8) // bs)
    torch.manual_seed(0)

    def cache() -> torch.Tensor:
        if args.layout == "head-major":
            return torch.randn(KV_HEADS, B * nb, bs, HEAD_DIM).transpose(0, 1)
        return torch.randn(B * nb, KV_HEADS, bs, HEAD_DIM)

    caches = [(cache(), cache()) for _ in range(LAYERS)]
    q = torch.randn(B, HEADS, HEAD_DIM)
    blocks = torch.arange(B * nb, dtype=torch.int32)
    tables = (blocks.view(nb, B).t() if args.interleave else blocks.view(B, nb)).contiguous()
    lengths = torch.full((B,), L, dtype=torch.int64)
    libs = {str(src): cpu_kernels.open_library(src) for src in args.sources}
    times = {(name, mode): [] for name in libs for mode in ("cold", "hot")}
    outputs = {}
    for _ in range(args.repeats):
        for name, lib in libs.items():
            for mode in ("cold", "hot"):
                out = torch.empty_like(q)
                t = time.perf_counter()
                for layer in range(LAYERS):
                    k, v = caches[layer if mode == "cold" else 0]
                    lib.fl_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), nb, lengths.data_ptr(),
                                            B, HEADS, KV_HEADS, HEAD_DIM, bs, k.stride(0), k.stride(1), HEAD_DIM**-0.5, out.data_ptr())
                times[(name, mode)].append(time.perf_counter() - t)
                outputs[name] = out
    first = next(iter(outputs.values()))
    kv_bytes = LAYERS * B * KV_HEADS * L * HEAD_DIM * 4 * 2
    print(f"batch {B}, {L} cached tokens in {args.layout} blocks of {bs}{', interleaved' if args.interleave else ''}, {LAYERS} layers, {HEADS}/{KV_HEADS} heads, dim {HEAD_DIM}; "
          f"{kv_bytes / 1e6:.0f} MB of K/V a step; best of {args.repeats}")
    for name in libs:
        diff = (outputs[name] - first).abs().max().item()
        cold, hot = min(times[(name, "cold")]), min(times[(name, "hot")])
        print(f"{name}: cold {cold * 1e3:.3f} ms ({kv_bytes / cold / 1e9:.1f} GB/s), hot {hot * 1e3:.3f} ms, "
              f"median cold {statistics.median(times[(name, 'cold')]) * 1e3:.3f} ms; max |diff| vs the first {diff:.1e}")


if __name__ == "__main__":
    main()
