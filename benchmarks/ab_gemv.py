"""A/B of the panel GEMV kernels alone, in C: a harness that includes each kernel source is built
and the builds run in turn (the same random weights, one thread, each matrix in L2), so that a
kernel edit is seen apart from memory speed and the decode step's other stages
(benchmarks/ab_kernels.py times whole steps). Prints microseconds a call and the second build's
speed against the first's for each width and row count, and checks that the builds' outputs agree.

    cp fasterllama/backends/cpu/csrc/cpu_kernels.c /tmp/edit.c   # then edit /tmp/edit.c
    python benchmarks/ab_gemv.py fasterllama/backends/cpu/csrc/cpu_kernels.c /tmp/edit.c [--widths 4,8,l5,l6] [--rows 1,2,4,8]

Widths are the C kernels' codes: 2-6 and 8 bits, nl4 (IQ4_NL), l5 / l6 (5 and 6 bits in 16-bit
lanes: the AVX2 build's layout for Q5_0/Q5_K/Q6_K). Each call computes 512 outputs from 576 inputs
in groups of 32 (fp16 scales, no mins: a centred type's path).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from fasterllama.backends.cpu import kernels as cpu_kernels

WIDTHS = {"2": 2, "3": 3, "4": 4, "5": 5, "6": 6, "8": 8, "nl4": 9, "l5": 10, "l6": 11}

HARNESS = r"""
#include <stdio.h>
#include <time.h>
#include <omp.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
/* argv: width code, N, K, rows, calls. Prints the best microseconds a call over 9 rounds, then a checksum. */
int main(int argc, char **argv) {
    const int bits = atoi(argv[1]), M = atoi(argv[4]), calls = atoi(argv[5]);
    const int64_t N = atoll(argv[2]), K = atoll(argv[3]), g = 32, P = N / PANEL, G = K / g, qbytes = P * G * g * COL_BYTES(bits);
    omp_set_num_threads(1);
    srand(1);
    uint8_t *q = aligned_alloc(64, (qbytes + 63) & ~63);
    uint16_t *s = aligned_alloc(64, P * G * PANEL * 2);
    float *x = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N);
    for (int64_t i = 0; i < qbytes; i++) q[i] = rand();
    if (LANES(bits)) for (int64_t i = 0; i < qbytes / 2; i++) ((uint16_t *)q)[i] &= 0x7fff;
    for (int64_t i = 0; i < P * G * PANEL; i++) s[i] = 0x2000 + (rand() & 0xff); /* fp16 ~0.008 */
    for (int64_t i = 0; i < M * K; i++) x[i] = (rand() % 2001 - 1000) / 1000.f;
    double best = 1e9;
    for (int round = 0; round < 9; round++) {
        const double t0 = now();
        for (int c = 0; c < calls; c++) fl_panel_linear(x, M, K, q, s, NULL, 2, NULL, NULL, 0, N, g, bits, y);
        const double dt = (now() - t0) / calls;
        best = dt < best ? dt : best;
    }
    double sum = 0;
    for (int64_t i = 0; i < M * N; i++) sum += y[i] * (1 + i % 7);
    printf("%.4f %.9g\n", best * 1e6, sum);
    return 0;
}
"""


def build(source: Path, folder: Path, name: str) -> Path:
    harness = folder / f"{name}.c"
    harness.write_text(f'#include "{source.resolve()}"\n' + HARNESS)
    exe = folder / name
    cc, flags = cpu_kernels.compiler()  # the engine's build, $FASTERLLAMA_CFLAGS (e.g. -mno-avx512f) included
    cpu_kernels._compile(cc, [f for f in flags if f not in ("-fPIC", "-shared")], harness, exe)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs=2, type=Path)
    ap.add_argument("--widths", default="4,8,l5,l6", help="comma-separated: " + ",".join(WIDTHS))
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=5, help="alternating runs of each build per case")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    unknown = set(args.widths.split(",")) - set(WIDTHS)
    if unknown:
        ap.error(f"unknown widths {', '.join(sorted(unknown))}; choose from {','.join(WIDTHS)}")
    with tempfile.TemporaryDirectory() as tmp:
        exes = [build(src, Path(tmp), f"h{i}") for i, src in enumerate(args.sources)]
        print(f"{'width':>5s} {'rows':>4s} {'first us':>9s} {'second us':>9s} {'speed':>6s}  outputs")
        for width in args.widths.split(","):
            for rows in args.rows.split(","):
                times: list[list[float]] = [[], []]
                sums: list[float] = [0.0, 0.0]
                for _ in range(args.repeats):
                    for i, exe in enumerate(exes):
                        out = subprocess.run([str(exe), str(WIDTHS[width]), "512", "576", rows, str(args.calls)], check=True,
                                             capture_output=True, text=True).stdout.split()
                        times[i].append(float(out[0]))
                        sums[i] = float(out[1])
                a, b = statistics.median(times[0]), statistics.median(times[1])
                agree = "agree" if abs(sums[0] - sums[1]) <= 1e-4 * max(1.0, abs(sums[0])) else f"DIFFER ({sums[0]:.6g} vs {sums[1]:.6g})"
                print(f"{width:>5s} {rows:>4s} {a:9.2f} {b:9.2f} {a / b:5.2f}x  {agree}")


if __name__ == "__main__":
    main()
