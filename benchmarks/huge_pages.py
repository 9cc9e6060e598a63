"""Decode steps with the weights in 2 MB pages (the default on Linux) against the same model left in
4 KB pages (FASTERLLAMA_HUGE_PAGES=0), both loaded in one process and alternating, so that this
machine's drifting memory speed falls on both alike.

    python benchmarks/huge_pages.py [--quantization none] [--batch 1] [--repeats 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from fasterllama import LLM, SamplingParams
from fasterllama.backends.cpu import huge_pages
from fasterllama.bench import fixed_prompt_ids


def load(quantization: str | None, in_huge_pages: bool) -> LLM:
    os.environ["FASTERLLAMA_HUGE_PAGES"] = "1" if in_huge_pages else "0"
    try:
        llm = LLM(None, progress=False, quantization=quantization)
        huge_pages.wait()  # (large tensors collapse on a thread: compare the finished layout)
        return llm
    finally:
        del os.environ["FASTERLLAMA_HUGE_PAGES"]


def step_ms(llm: LLM, batch: int, steps: int, prompt_len: int = 128) -> float:
    """Mean decode step time over `steps` steps of `batch` greedy sequences (after their prefill
    of `prompt_len` tokens each)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 6, ignore_eos=True)
    seqs = [engine.add_request(fixed_prompt_ids(prompt_len, llm.config.vocab_size, seed=i), params) for i in range(batch)]
    while any(len(s.output_token_ids) < 6 for s in seqs):
        engine.step()
    t, n = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default=None, help="as LLM(quantization=...); default: the file's own tensors")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    engines = {"4 KB pages": load(args.quantization, False), "2 MB pages": load(args.quantization, True)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            times[name].append(step_ms(llm, args.batch, args.steps))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name}: {med[name]:.2f} ms a step (batch {args.batch}; runs {' '.join(f'{x:.2f}' for x in t)})")
    print(f"2 MB pages: {med['4 KB pages'] / med['2 MB pages']:.3f}x the step rate of 4 KB pages")


if __name__ == "__main__":
    main()
