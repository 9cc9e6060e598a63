"""fp32 GEMM rates at the model's prefill shapes: MKL (torch's default CPU sgemm, what HF
transformers runs), oneDNN (fasterllama's `cpu_kernels.sgemm`) and the CPU's FMA peak.

    python benchmarks/gemm_cpu.py [--threads 2] [--rows 128,512]

Why: MKL picks its code path by CPU vendor and runs AVX2 code on AMD CPUs, so on an AVX-512 AMD
machine "the GEMM rate" depends on the library asked. The peak is measured, not looked up: a
compiled loop of independent FMAs on every thread (AVX-512 where the CPU has it, else AVX2)."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

FMA_LOOP = r"""
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
#ifdef __AVX512F__
typedef __m512 vf;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define LANES 16
#else
typedef __m256 vf;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define LANES 8
#endif
#define F(a) a = FMA(a, b, c);
/* Opaque to the optimizer: chains that start equal would be merged into one (gcc does that). */
#define OPAQUE(v) __asm__ volatile("" : "+v"(v))
int main(void) {
    const long iters = 50000000;
    double t = omp_get_wtime();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
        const vf b = SET1(0.999f), c = SET1(1e-4f); /* 12 independent chains: latency 4 x 2 pipes, with room */
        vf a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5), a6 = SET1(6), a7 = SET1(7), a8 = SET1(8),
           a9 = SET1(9), a10 = SET1(10), a11 = SET1(11);
        OPAQUE(a0); OPAQUE(a1); OPAQUE(a2); OPAQUE(a3); OPAQUE(a4); OPAQUE(a5); OPAQUE(a6); OPAQUE(a7); OPAQUE(a8); OPAQUE(a9); OPAQUE(a10); OPAQUE(a11);
        for (long i = 0; i < iters; i++) { F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11) }
        float out[LANES];
        vf s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
        __builtin_memcpy(out, &s, sizeof out);
        sink += out[0];
    }
    t = omp_get_wtime() - t;
    printf("%f %f\n", omp_get_max_threads() * iters * 12.0 * 2 * LANES / t / 1e9, sink);
    return 0;
}
"""


def fma_peak_gflops(threads: int) -> float | None:
    """The fp32 FMA rate of `threads` threads, in GFLOP/s; None without gcc."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "fma.c", Path(tmp) / "fma"
        src.write_text(FMA_LOOP)
        try:
            subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True, capture_output=True)
            out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        except (OSError, subprocess.CalledProcessError):
            return None
    return float(out.stdout.split()[0])


def gemm_gflops(fn, x: torch.Tensor, w: torch.Tensor, repeats: int = 20) -> float:
    fn(x, w)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            fn(x, w)
        best = min(best, (time.perf_counter() - t) / repeats)
    return 2 * x.shape[0] * x.shape[1] * w.shape[0] / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="128,512", help="activation rows (prompt tokens)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from fasterllama.backends.cpu import kernels as cpu_kernels

    peak = fma_peak_gflops(args.threads)
    print(f"{time.strftime('%Y-%m-%d')}  threads={args.threads}  fp32 FMA peak: " + (f"{peak:.0f} GFLOP/s" if peak else "unknown (no gcc)"))
    print("\n| rows | K x N (SmolLM2-135M) | MKL GFLOP/s | oneDNN GFLOP/s | oneDNN / MKL |" + (" oneDNN of peak |" if peak else ""))
    print("|---|---|---|---|---|" + ("---|" if peak else ""))
    shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
    for m in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in shapes.items():
            x, w = torch.randn(m, k), torch.randn(n, k)
            mkl, onednn = gemm_gflops(F.linear, x, w), gemm_gflops(cpu_kernels.sgemm, x, w)
            row = f"| {m} | {name} {k} x {n} | {mkl:.0f} | {onednn:.0f} | {onednn / mkl:.2f}x |"
            print(row + (f" {onednn / peak:.0%} |" if peak else ""))


if __name__ == "__main__":
    main()
