"""What sampling costs a decode step: greedy vs sampled decoding of the same prompt and token
count, the sampled draw made by the backend's one-pass kernel (ops `sample_rows`) or by the
PyTorch sampler (engine/sampler.py, ~20 tensor ops over the vocabulary), alternating in one
process.

    python benchmarks/sampling.py [--model M] [--max-tokens 128] [--batch 1] [--rounds 3]

Sampled rows use the CLI's defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) and the
OpenAI API's (temperature 1, no filter). Prints tok/s of each mode (medians) and the ratios, then
the draw alone on the model's real logits (the prompt's last row, --batch copies of it): µs of the
kernel and of the PyTorch sampler, and whether they drew the same tokens."""

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
    if fused is not None:
        draw_alone(llm, prompts, list(params.items())[1:], fused, args.rounds)


def draw_alone(llm: LLM, prompts: list[list[int]], params: list[tuple[str, SamplingParams]], fused, rounds: int) -> None:
    """The draw by itself on real logits: the kernel against the PyTorch sampler (medians of alternating rounds)."""
    from fasterllama.engine import sampler
    from fasterllama.engine.sequence import Sequence

    logits = llm.compute_logits(prompts[0])[-1:].float().expand(len(prompts), -1).contiguous()
    V = logits.shape[1]
    print(f"  the draw alone, {len(prompts)} row(s) of the prompt's last logits (vocabulary {V}):")
    for name, p in params:
        rows = [(Sequence(prompts[0], p, None, p.seed + i), []) for i in range(len(prompts))]
        b = sampler.sampling_batch(rows, V, [], logits.device)
        ways = {"kernel": lambda b=b: fused(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps),
                "PyTorch": lambda b=b: sampler.reference_sample(logits, b)}
        same = torch.equal(ways["kernel"](), ways["PyTorch"]())
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(max(5, rounds)):
            for w, fn in ways.items():
                t = time.perf_counter()
                for _ in range(10):
                    fn()
                times[w].append((time.perf_counter() - t) / 10)
        k, ref = (statistics.median(times[w]) * 1e6 for w in ways)
        print(f"    {name}: {k:.0f} us, PyTorch sampler {ref:.0f} us ({ref / k:.1f}x); same tokens: {same}")


if __name__ == "__main__":
    main()
