"""Batching without padding: 8 mixed-length prompts decoded as one packed batch, vs one at a
time, vs a padded batch (every prompt left-padded to the longest, as a padded engine computes).

    python benchmarks/batching.py [--model M] [--quantization none] [--max-tokens 128] [--repeats 3]

Prints wall time and generated tokens/s of each mode (medians), and the ratios."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fasterllama import LLM, SamplingParams

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring, "
    "then by punched cards, then by assembly language, and finally by high-level languages that let "
    "people describe what they wanted rather than how to do it. "
) * 10
LENGTHS = [3, 200, 17, 64, 5, 120, 33, 90]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default=None, help="none: fp32 weights (default: the GGUF's 4-bit tensors kept)")
    args = ap.parse_args()
    llm = LLM(args.model, quantization=args.quantization, progress=False, enable_prefix_caching=False)  # every run computes its prompts
    ids = llm.tokenizer.encode(TEXT)
    prompts = [ids[i * 7 : i * 7 + n] for i, n in enumerate(LENGTHS)]
    pad = llm.tokenizer.token_to_id(llm.tokenizer.special_tokens.get("pad_token") or "") or 0
    longest = max(LENGTHS)
    padded = [[pad] * (longest - len(p)) + p for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    n_tokens = args.max_tokens * len(prompts)

    def packed() -> None:
        llm.generate(prompts, params)

    def sequential() -> None:
        for p in prompts:
            llm.generate([p], params)

    def padded_batch() -> None:
        llm.generate(padded, params)

    modes = {"packed batch": packed, "one at a time": sequential, "padded batch": padded_batch}
    times: dict[str, list[float]] = {m: [] for m in modes}
    packed()  # warm-up
    for _ in range(args.repeats):  # interleaved, so drift hits every mode alike
        for name, fn in modes.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(f"8 prompts of {LENGTHS} tokens, {args.max_tokens} greedy tokens each, torch threads={torch.get_num_threads()}")
    med = {m: statistics.median(t) for m, t in times.items()}
    for name, t in med.items():
        print(f"  {name:14s} {t:7.2f} s  {n_tokens / t:7.1f} generated tok/s")
    print(f"packed batch vs one at a time: {med['one at a time'] / med['packed batch']:.2f}x")
    print(f"packed batch vs padded batch:  {med['padded batch'] / med['packed batch']:.2f}x")


if __name__ == "__main__":
    main()
