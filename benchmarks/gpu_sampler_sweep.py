"""The sampler (backends/cuda/triton_sampling.py: chunk kernel + row kernel) at the default model's
vocabulary: median µs a sample_rows call over its block and chunk sizes, for top-k 40 + top-p 0.95
(the CLI's), top-p alone and top-k alone (served from the chunks' candidates) and top-k 100 (past
LOCAL_CAP: the passes over the whole row, as the one-kernel sampler of 2026-11-30 made every row),
at 1 and 16 rows; each config's tokens checked against the module defaults'. On a CUDA GPU:
`python benchmarks/gpu_sampler_sweep.py`; `TRITON_INTERPRET=1 python benchmarks/gpu_sampler_sweep.py
--quick` runs it on the CPU at a small vocabulary (the script's check, not a timing)."""

from __future__ import annotations

import argparse
import time

import torch
import triton

from fasterllama.backends.cuda import triton_sampling as ts


def _wall_ms(fn) -> float:
    """One call's wall time (the interpreter has no device to time with)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CPU under TRITON_INTERPRET=1, 2,500 tokens, one timing rep")
    args = ap.parse_args()
    dev, V = ("cpu", 2500) if args.quick else ("cuda", 49152)
    bench = _wall_ms if args.quick else (lambda fn: triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median"))
    defaults = (ts.BLOCK, ts.CHUNK)
    for rows in (1, 16):
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(rows, V, device=dev, generator=g) * 3
        t, mp = torch.full((rows,), 0.8, device=dev), torch.full((rows,), 0.05, device=dev)
        k, p = torch.empty(rows, dtype=torch.long, device=dev), torch.empty(rows, device=dev)
        seeds, steps = torch.arange(rows, device=dev), torch.zeros(rows, dtype=torch.long, device=dev)
        inputs = (x, t, k, p, mp, seeds, steps)
        for top_k, top_p in ((40, 0.95), (0, 0.95), (40, 1.0), (100, 1.0)):
            k.fill_(top_k)
            p.fill_(top_p)
            ts.BLOCK, ts.CHUNK = defaults
            want = ts.sample_rows(*inputs)
            for block in (2048, 4096):
                for chunk in (1024, 2048, 4096):
                    ts.BLOCK, ts.CHUNK = block, chunk
                    same = bool((ts.sample_rows(*inputs) == want).all())
                    us = bench(lambda inputs=inputs: ts.sample_rows(*inputs)) * 1000
                    print(f"rows {rows:2d}  top-k {top_k:3d}  top-p {top_p:.2f}  block {block}  chunk {chunk}: {us:7.1f} us  same tokens: {same}",
                          flush=True)
    ts.BLOCK, ts.CHUNK = defaults


if __name__ == "__main__":
    main()
