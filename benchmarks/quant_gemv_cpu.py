"""The quantized GEMV kernels alone, on weights in panels, cold: 30 copies of a matrix (one per
layer, as a decode step reads them) are used in turn, so each call streams its weights from DRAM.
Prints µs a call, GB/s of weights and GFLOP/s at SmolLM2-135M's shapes. Calls go through the Python
op (cpu_kernels.panel_linear), whose ~5-8 µs of overhead are included.

    python benchmarks/quant_gemv_cpu.py [--rows 1,2,8] [--repeats 20]
    python benchmarks/quant_gemv_cpu.py --widths 2,3,4,nl4 [--rows 1]   # the panel widths side by side

--widths compares the GGUF block types' panel widths (2: Q2_K, 3: Q3_K, 4: Q4_K, 5: Q5_K, 6: Q6_K,
nl4: IQ4_XS, 8: Q8_0-like; each with its type's group and factored scales) on the same shapes,
alternating round by round in one process, and prints each one's weights a second against 4-bit's.
"""

from __future__ import annotations

import argparse
import statistics
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


WIDTH_GROUPS = {"2": (2, 16), "3": (3, 16), "4": (4, 32), "5": (5, 32), "6": (6, 16), "nl4": (qops.NL4, 32), "8": (8, 32)}


def width_matrices(n: int, k: int, width: str, copies: int) -> list:
    """PackedLinears of one panel width with a K-quant's factored scales (int8 x fp16 per 256)."""
    from fasterllama.quant.linear import PackedLinear

    bits, g = WIDTH_GROUPS[width]
    values = 16 if bits == qops.NL4 else 1 << bits
    out = []
    for _ in range(copies):
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8) if bits == 8 else torch.randint(0, values, (n, k), dtype=torch.uint8)
        sub, sup = torch.randint(-32, 32, (n, k // g), dtype=torch.int8), (torch.rand(n, k // 256) * 0.01).half()
        out.append(PackedLinear(q, sub, None, bits, scale_super=sup))
    return out


def compare_widths(widths: list[str], m: int, repeats: int) -> None:
    for n, k, copies in ((576, 1536, 30), (4096, 4096, 4)):
        mats = {w: width_matrices(n, k, w, copies) for w in widths}
        x = torch.randn(m, k)
        times: dict[str, list[float]] = {w: [] for w in widths}
        for _ in range(repeats):
            for w, lins in mats.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    for lin in lins:
                        ck.panel_linear(x, lin.qweight, lin.scales, lin.mins, n, lin.bits, None, lin.sups)
                times[w].append((time.perf_counter() - t0) / (5 * len(lins)))
        base = statistics.median(times["4"]) if "4" in times else None
        for w, t in times.items():
            dt = statistics.median(t)
            nbytes = sum(p.numel() * p.element_size() for p in mats[w][0].parameters())
            vs = f"  {base / dt:5.2f}x 4-bit's weights a second" if base else ""
            print(f"{n:5d} x {k:5d} width {w:>3s}, rows {m}: {dt * 1e6:8.1f} µs  {nbytes / dt / 1e9:5.1f} GB/s  {n * k / dt / 1e9:5.1f} G weights/s{vs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--widths", default=None, help="compare panel widths (comma-separated: 2, 3, 4, 5, 6, nl4, 8)")
    args = ap.parse_args()
    if ck.load() is None:
        raise SystemExit("the C kernels cannot be built here")
    torch.manual_seed(0)
    if args.widths:
        bad = [w for w in args.widths.split(",") if w not in WIDTH_GROUPS]
        if bad:
            raise SystemExit(f"unknown width {bad[0]!r} (known: {', '.join(WIDTH_GROUPS)})")
        for m in (int(r) for r in args.rows.split(",")):
            compare_widths(args.widths.split(","), m, max(3, args.repeats // 4))
        return
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
