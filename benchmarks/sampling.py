"""What sampling costs a decode step: greedy vs sampled decoding of the same prompt and token
count, the sampled draw made by the backend's one-pass kernel (ops `sample_rows`) or by the
PyTorch sampler (engine/sampler.py, ~20 tensor ops over the vocabulary), alternating in one
process.

    python benchmarks/sampling.py [--model M] [--max-tokens 128] [--batch 1] [--rounds 3]

Sampled rows use the CLI's defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) and the
OpenAI API's (temperature 1, no filter). Prints tok/s of each mode (medians) and the ratios."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fasterllama import LLM, SamplingParams, ops

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, progress=False)
    device = llm.engine.device
    prompts = [llm.tokenizer.encode(PROMPT)] * args.batch
    n = args.max_tokens
    params = {
        "greedy": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        "CLI defaults (t 0.8, top-k 40, top-p 0.95, min-p 0.05)": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                                                                 max_tokens=n, ignore_eos=True, seed=1),
        "OpenAI defaults (t 1)": SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=1),
    }
    fused = ops.registered("sample_rows", device)
    table = ops._BACKENDS.get(device.type, {})

    def run(p: SamplingParams, with_kernel: bool) -> float:
        if fused is not None:
            if with_kernel:
                table["sample_rows"] = fused
            else:
                table.pop("sample_rows", None)
        t = time.perf_counter()
        out = llm.generate(prompts, p)
        elapsed = time.perf_counter() - t
        assert sum(len(o.token_ids) for o in out) == n * args.batch
        return n * args.batch / elapsed

    modes = [("greedy", True)] + [(name, k) for name in list(params)[1:] for k in ((True, False) if fused else (False,))]
    rates: dict[tuple[str, bool], list[float]] = {m: [] for m in modes}
    run(params["greedy"], True)  # warm-up
    for _ in range(args.rounds):  # interleaved: drift hits every mode alike
        for name, k in modes:
            rates[(name, k)].append(run(params[name], k))
    if fused is not None:
        table["sample_rows"] = fused
    print(f"{device.type}, batch {args.batch}, {n} tokens, torch threads={torch.get_num_threads()}, median of {args.rounds} rounds")
    greedy = statistics.median(rates[("greedy", True)])
    print(f"  greedy: {greedy:.1f} tok/s")
    for name, k in modes[1:]:
        r = statistics.median(rates[(name, k)])
        print(f"  {name}, {'one-pass kernel' if k else 'PyTorch sampler'}: {r:.1f} tok/s ({r / greedy:.2f}x greedy)")


if __name__ == "__main__":
    main()
