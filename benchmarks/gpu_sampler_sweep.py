"""The one-launch sampler (backends/cuda/triton_sampling.py) at the default model's vocabulary:
median µs a launch over block sizes and warps, for top-k 40 + top-p 0.95 (the CLI's), top-p alone
and top-k alone, at 1 and 16 rows; each config's tokens checked against the module's default
launch. Needs a CUDA GPU: `python benchmarks/gpu_sampler_sweep.py`."""

from __future__ import annotations

import torch
import triton

from fasterllama.backends.cuda import pdl
from fasterllama.backends.cuda import triton_sampling as ts

V = 49152


def time_launch(args: tuple, rows: int, block: int, warps: int) -> float:
    """Median µs of one _sample_kernel launch over args (its tensors and V, stride)."""
    x = args[0]
    return triton.testing.do_bench(lambda: ts._sample_kernel[(rows,)](*args, BLOCK=block, CAP=ts.CAP, num_warps=warps, **pdl.launch_args(x)),
                                   warmup=20, rep=60, return_mode="median") * 1000


def main() -> None:
    for rows in (1, 16):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(rows, V, device="cuda", generator=g) * 3
        t, mp = torch.full((rows,), 0.8, device="cuda"), torch.full((rows,), 0.05, device="cuda")
        k, p = torch.empty(rows, dtype=torch.long, device="cuda"), torch.empty(rows, device="cuda")
        seeds, steps = torch.arange(rows, device="cuda"), torch.zeros(rows, dtype=torch.long, device="cuda")
        out = torch.empty(rows, dtype=torch.long, device="cuda")
        cx, ci = torch.empty(rows, ts.CAP, device="cuda"), torch.empty(rows, ts.CAP, dtype=torch.int32, device="cuda")
        args = (x, t, k, p, mp, seeds, steps, out, cx, ci, V, x.stride(0))
        for top_k, top_p in ((40, 0.95), (0, 0.95), (40, 1.0)):
            k.fill_(top_k)
            p.fill_(top_p)
            want = ts.sample_rows(x, t, k, p, mp, seeds, steps)
            for block in (1024, 2048, 4096):
                for warps in (4, 8, 16):
                    us = time_launch(args, rows, block, warps)  # (its launches leave their tokens in out)
                    print(f"rows {rows:2d}  top-k {top_k:2d}  top-p {top_p:.2f}  block {block}  warps {warps:2d}: {us:7.1f} us  "
                          f"same tokens: {bool((out == want).all())}", flush=True)


if __name__ == "__main__":
    main()
