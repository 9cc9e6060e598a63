"""A/B of kernel edits: decode steps with libraries built from two or more C sources, alternating
in one process on one loaded model, so that this machine's drifting memory speed falls on all of
them alike (separate runs minutes apart differ by up to 30% here).

    cp fasterllama/backends/cpu/csrc/cpu_kernels.c /tmp/edit.c   # then edit /tmp/edit.c
    python benchmarks/ab_kernels.py fasterllama/backends/cpu/csrc/cpu_kernels.c /tmp/edit.c [--model GGUF] [--batch 8] [--quantization none] [--prompt-len 2000]

--prefill times whole prompts of --prompt-len tokens instead (time to the first token, as
benchmarks/compare_cpu.py's prefill).

Each source must keep the exported functions' signatures (backends/cpu/kernels.py _SIGNATURES).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from huge_pages import step_ms  # same timing loop

from fasterllama import LLM
from fasterllama.backends.cpu import kernels as cpu_kernels
from fasterllama.bench import _prefill_seconds, fixed_prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--model", default=None, help="a model path (default: the default model)")
    ap.add_argument("--quantization", default=None, help="as LLM(quantization=...); default: the file's own tensors")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens in each sequence's cache when decoding starts")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--prefill", action="store_true", help="time prompts of --prompt-len tokens, not decode steps")
    args = ap.parse_args()
    llm = LLM(args.model, progress=False, quantization=args.quantization)
    ids = fixed_prompt_ids(args.prompt_len, llm.config.vocab_size)
    libs = {str(src): cpu_kernels.open_library(src) for src in args.sources}
    times: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(args.repeats):
        for name, lib in libs.items():
            cpu_kernels._lib = lib  # every C op and the one-call decode step go through this handle
            times[name].append(prefill_ms(llm, ids, args.steps) if args.prefill else step_ms(llm, args.batch, args.steps, args.prompt_len))
    base = statistics.median(times[str(args.sources[0])])
    what = f"a prompt of {args.prompt_len}" if args.prefill else f"a step (batch {args.batch}, prompt {args.prompt_len})"
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name}: {med:.2f} ms {what}, {base / med:.3f}x the first (runs {' '.join(f'{x:.2f}' for x in t)})")


def prefill_ms(llm: LLM, ids: list[int], calls: int) -> float:
    """Median milliseconds of `calls` prefills of ids (each to its first token)."""
    return statistics.median(_prefill_seconds(llm, ids) for _ in range(calls)) * 1e3


if __name__ == "__main__":
    main()
