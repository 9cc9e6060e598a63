"""Where a decode step's time goes: the stages of the one-call C decode step (embedding to
logits) and the Python around it (scheduling, sampling, bookkeeping).

    python benchmarks/profile_decode.py [--model M] [--quantization Q] [--batch 1] [--steps 100]

Prints milliseconds per step and the share of each part."""

from __future__ import annotations

import argparse
import time

import torch

from fasterllama import LLM, SamplingParams
from fasterllama.bench import fixed_prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    llm = LLM(args.model, quantization=args.quantization, progress=False)
    engine, runner = llm.engine, llm.engine.runner
    plan = runner.decode_plan
    if plan is None:
        raise SystemExit("this model/device does not use the one-call CPU decode step")
    vocab = llm.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True)
    seqs = [engine.add_request(fixed_prompt_ids(args.prompt_len, vocab, seed=i), params) for i in range(args.batch)]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    for _ in range(10):  # warm-up
        engine.step()

    timings = {"forward": 0.0}

    def timed(key, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            timings[key] += time.perf_counter() - t
            return out
        return wrapper

    plan.run = timed("forward", plan.run)
    plan.start_profile()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = (time.perf_counter() - t0) / args.steps
    forward = timings["forward"] / args.steps
    stages = {k: v / args.steps for k, v in plan.profile_report().items()}
    print(f"decode step, batch {args.batch}, {llm.engine.quant_config or 'float weights'}, threads={torch.get_num_threads()}: "
          f"{total * 1e3:.2f} ms ({args.batch / total:.1f} tok/s)")
    rows = [(f"  C: {k}", v) for k, v in stages.items()]
    rows.append(("  Python around the C step (inputs, logits buffer, ctypes)", forward - sum(stages.values())))
    rows.append(("scheduler, sampler, bookkeeping", total - forward))
    print(f"{'part':58s} {'ms/step':>8s} {'share':>6s}")
    for name, secs in rows:
        print(f"{name:58s} {secs * 1e3:8.3f} {secs / total:6.1%}")


if __name__ == "__main__":
    main()
