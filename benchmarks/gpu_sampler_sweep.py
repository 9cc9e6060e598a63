"""The sampler (backends/cuda/triton_sampling.py: chunk kernel + row kernel) at the default model's
vocabulary: median µs a sample_rows call over its block and chunk sizes, for top-k 40 + top-p 0.95
(the CLI's), top-p alone and top-k alone (served from the chunks' candidates) and top-k 100 (past
LOCAL_CAP: the passes over the whole row, as the one-kernel sampler of 2026-11-30 made every row),
at 1 and 16 rows; each config's tokens checked against the module defaults'. Needs a CUDA GPU:
`python benchmarks/gpu_sampler_sweep.py`."""

from __future__ import annotations

import torch
import triton

from fasterllama.backends.cuda import triton_sampling as ts

V = 49152


def main() -> None:
    defaults = (ts.BLOCK, ts.CHUNK)
    for rows in (1, 16):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(rows, V, device="cuda", generator=g) * 3
        t, mp = torch.full((rows,), 0.8, device="cuda"), torch.full((rows,), 0.05, device="cuda")
        k, p = torch.empty(rows, dtype=torch.long, device="cuda"), torch.empty(rows, device="cuda")
        seeds, steps = torch.arange(rows, device="cuda"), torch.zeros(rows, dtype=torch.long, device="cuda")
        args = (x, t, k, p, mp, seeds, steps)
        for top_k, top_p in ((40, 0.95), (0, 0.95), (40, 1.0), (100, 1.0)):
            k.fill_(top_k)
            p.fill_(top_p)
            ts.BLOCK, ts.CHUNK = defaults
            want = ts.sample_rows(*args)
            for block in (2048, 4096):
                for chunk in (1024, 2048, 4096):
                    ts.BLOCK, ts.CHUNK = block, chunk
                    same = bool((ts.sample_rows(*args) == want).all())
                    us = triton.testing.do_bench(lambda args=args: ts.sample_rows(*args), warmup=20, rep=60, return_mode="median") * 1000
                    print(f"rows {rows:2d}  top-k {top_k:3d}  top-p {top_p:.2f}  block {block}  chunk {chunk}: {us:7.1f} us  same tokens: {same}",
                          flush=True)
    ts.BLOCK, ts.CHUNK = defaults


if __name__ == "__main__":
    main()
