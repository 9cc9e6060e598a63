"""Head-of-line blocking: how long a short chat request waits for its first token when it arrives
while a 6,000-token prompt is being prefilled (default model, greedy), under the scheduler's rule
(a prefill takes a quarter of the step's budget while requests wait to start) and the old one (a
prefill takes the whole budget), alternating in one process; each long prompt is new (nothing
from the prefix cache).

    python benchmarks/head_of_line.py [--rounds 2]"""

from __future__ import annotations

import argparse
import time

from fasterllama import LLM, SamplingParams
from fasterllama.engine import scheduler


def first_token_wait(engine, old_rule: bool, first_id: int) -> tuple[float, int]:
    """(seconds, steps) from the short request's arrival to its first token."""
    rule = scheduler.Scheduler._starts_waiting
    if old_rule:
        scheduler.Scheduler._starts_waiting = lambda self: False  # a prefill takes the whole budget
    try:
        engine.add_request(list(range(first_id, first_id + 6000)), SamplingParams(temperature=0, max_tokens=4))
        engine.step()  # the long prompt's first chunk
        short = engine.add_request(engine.encode_prompt("What is the capital of France?"), SamplingParams(temperature=0, max_tokens=4))
        start, steps = time.perf_counter(), 0
        while not short.output_token_ids:
            engine.step()
            steps += 1
        waited = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        return waited, steps
    finally:
        scheduler.Scheduler._starts_waiting = rule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    engine = LLM(progress=False).engine
    for r in range(args.rounds):
        for old_rule in (True, False):
            waited, steps = first_token_wait(engine, old_rule, 1000 + 7000 * (2 * r + old_rule))
            print(f"{'old rule' if old_rule else 'new rule'}: the short request's first token after {steps} steps, {waited:.2f} s", flush=True)


if __name__ == "__main__":
    main()
