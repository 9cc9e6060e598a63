"""Structured output's cost: decode tok/s of a batch constrained by a JSON schema against the same
batch unconstrained (same prompts, same number of tokens each), alternating in one process, and
the time per step spent on the token masks (llguidance's bitmasks + applying them).

    python benchmarks/structured.py [--model M] [--batch 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from fasterllama import LLM, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 30},
                         "hobbies": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 20}}}}


def decode_rate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """Generated tokens per second after every prompt is prefilled, and the tokens generated."""
    engine = llm.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    start, first = time.perf_counter(), sum(len(s.output_token_ids) for s in seqs)
    while engine.has_unfinished():
        engine.step()
    n = sum(len(s.output_token_ids) for s in seqs) - first
    return n / (time.perf_counter() - start), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, progress=False)
    prompts = [llm.chat_prompt([{"role": "user", "content": f"Describe person number {i} as JSON: name, age, city, hobbies."}])
               for i in range(args.batch)]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, json_schema=SCHEMA) for i in range(args.batch)]
    # the unconstrained batch decodes as many tokens per request as the constrained one did
    lengths = [len(o.token_ids) for o in llm.generate(prompts, constrained)]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    so = llm.engine.structured
    ratios, with_rates, without_rates, mask_ms = [], [], [], []
    for _ in range(args.rounds):
        seconds, steps = so.mask_seconds, so.mask_steps
        with_rate, _ = decode_rate(llm, prompts, constrained)
        mask_ms.append(1e3 * (so.mask_seconds - seconds) / max(1, so.mask_steps - steps))
        without_rate, _ = decode_rate(llm, prompts, free)
        with_rates.append(with_rate)
        without_rates.append(without_rate)
        ratios.append(with_rate / without_rate)
    print(f"batch {args.batch}, {sum(lengths)} tokens a round, {args.rounds} rounds (median):")
    print(f"  with a JSON schema {statistics.median(with_rates):.1f} tok/s, without {statistics.median(without_rates):.1f} tok/s: "
          f"{statistics.median(ratios):.3f}x (rounds {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"  masks: {statistics.median(mask_ms):.2f} ms per step")


if __name__ == "__main__":
    main()
