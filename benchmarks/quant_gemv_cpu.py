"""The quantized GEMV kernels alone, on weights in panels, cold: 30 copies of a matrix (one per
layer, as a decode step reads them) are used in turn, so each call streams its weights from DRAM.
Prints µs a call, GB/s of weights and GFLOP/s at SmolLM2-135M's shapes. Calls go through the Python
op (cpu_kernels.panel_linear), whose ~5-8 µs of overhead are included.

    python benchmarks/quant_gemv_cpu.py [--rows 1,2,8] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from fasterllama.backends.cpu import kernels as ck
from fasterllama.ops import quantized as qops

SHAPES = [("qkv 4-bit", 960, 576, 4), ("gate_up 4-bit", 3072, 576, 4), ("down 4-bit", 576, 1536, 4), ("lm_head Q8_0", 49152, 576, 8)]


def matrices(n: int, k: int, bits: int, copies: int) -> list[tuple]:
    out = []
    for _ in range(copies):
        if bits == 4:
            packed = qops.pack_int4(torch.randint(0, 16, (n, k)), 32)
            scales, mins = (torch.rand(n, k // 32) * 0.01).half(), (-torch.rand(n, k // 32) * 0.01).half()
            panels = qops.to_panels(packed, scales, mins, 32)
            out.append((lambda x, p=panels: ck.panel_linear(x, *p, n, 4), sum(t.numel() * t.element_size() for t in panels)))
        else:
            panels = qops.int8_to_panels(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32))
            out.append((lambda x, p=panels: ck.panel_linear(x, *p, None, n, 8), sum(t.numel() * t.element_size() for t in panels)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,8")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if ck.load() is None:
        raise SystemExit("the C kernels cannot be built here")
    torch.manual_seed(0)
    for name, n, k, bits in SHAPES:
        mats = matrices(n, k, bits, 30 if bits == 4 else 2)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            for fn, _ in mats:
                fn(x)
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                for fn, _ in mats:
                    fn(x)
            dt = (time.perf_counter() - t0) / (args.repeats * len(mats))
            nbytes = mats[0][1]
            print(f"{name:14s} {n:6d} x {k:5d}  rows {m}: {dt * 1e6:8.1f} µs  {nbytes / dt / 1e9:6.1f} GB/s  {2 * m * n * k / dt / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
