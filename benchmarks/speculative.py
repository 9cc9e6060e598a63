"""Speculative decoding's speedup: decode tok/s with prompt-lookup (n-gram) drafting at k = 2, 4, 8
against plain decoding, on prompts whose answers copy from the prompt (a paragraph rewritten with one
word changed, code edits) and on free text (where drafts rarely hold), alternating configurations
in one process on one engine (the same weights and cache), greedy, batch 1 by default.

Each round runs every prompt under every configuration back to back (alternating the order); a
configuration's rate is the group's generated tokens over its decode time (after the prompt's
prefill step), its speedup the ratio to plain decoding in the same round (median over rounds). Also: the share of drafted tokens accepted,
tokens per verify, and a check that every output equals plain decoding's token for token.

    python benchmarks/speculative.py [--model M] [--rounds 3] [--ks 2,4,8] [--batch 1] [--max-tokens 256]
        [--draft-model D [--draft-quantization Q] [--draft-ks 4]]

--draft-model adds draft-model configurations (D drafting k tokens; D may be the model itself, e.g.
quantized with --draft-quantization w4: drafts that always hold, at a draft step as slow as the
target's, which the cost model should decline).
"""

from __future__ import annotations

import argparse
import statistics
import time

from fasterllama import LLM, SamplingParams
from fasterllama.engine.speculative import SpeculativeConfig, make_speculator

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its lamp turned slowly, "
    "sending a beam of light across the dark water so that fishing boats could find their way home. The keeper, a quiet "
    "man named Thomas, climbed the narrow stairs twice a day to clean the glass and wind the clockwork that kept the light moving.",
    "Our team meets every Monday morning to plan the work of the week. Each person shares what they finished, what they are "
    "working on, and anything that is blocking them. The meeting should take no more than thirty minutes, and notes are posted "
    "in the shared folder so that anyone who missed it can catch up before lunch.",
]
CODE = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None

    def __len__(self):
        return len(self.items)
'''
COPY_PROMPTS = [
    f"Repeat this paragraph exactly, but with the word 'hundred' replaced by 'thousand':\n\n{PARAGRAPHS[0]}",
    f"Repeat this paragraph exactly, but with the word 'Monday' replaced by 'Tuesday':\n\n{PARAGRAPHS[1]}",
    "Fix the spelling mistakes in this paragraph and return the corrected paragraph:\n\n"
    + PARAGRAPHS[0].replace("stood", "stod").replace("slowly", "slowley").replace("narrow", "narow"),
    f"Rename the class `Stack` to `LifoStack` and show the whole class:\n\n```python\n{CODE}```",
    f"Add a docstring to the `pop` method of this class and show the whole class:\n\n```python\n{CODE}```",
    f"Change the error message in this code to \"stack is empty\" and show the whole code:\n\n```python\n{CODE}```",
]
FREE_PROMPTS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how a rainbow forms, for a ten year old.",
    "Give me five ideas for a rainy weekend, with a sentence on each.",
    "What are the pros and cons of working from home?",
]


def decode(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int, float]:
    """Every prompt's output tokens, the tokens generated after the first step, and their seconds."""
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    start, first = time.perf_counter(), sum(len(s.output_token_ids) for s in seqs)
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    return [s.output_token_ids for s in seqs], sum(len(s.output_token_ids) for s in seqs) - first, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ks", default="2,4,8", help="num_speculative_tokens values to compare")
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-lookup-min", type=int, default=None)
    ap.add_argument("--prompt-lookup-max", type=int, default=None)
    ap.add_argument("--draft-model", default=None, help="also compare a draft model drafting --draft-ks tokens")
    ap.add_argument("--draft-quantization", default=None)
    ap.add_argument("--draft-ks", default="4")
    args = ap.parse_args()
    llm = LLM(args.model, progress=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    lookup = {k: v for k, v in (("prompt_lookup_min", args.prompt_lookup_min), ("prompt_lookup_max", args.prompt_lookup_max)) if v is not None}
    configs: dict[str, object] = {"plain": None}
    for k in (int(x) for x in args.ks.split(",") if x):
        spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k, **lookup})
        configs[f"ngram k={k}"] = make_speculator(spec, engine, False)
    for k in (int(x) for x in args.draft_ks.split(",") if x and args.draft_model):
        spec = SpeculativeConfig.parse({"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k,
                                        **({"quantization": args.draft_quantization} if args.draft_quantization else {})})
        configs[f"draft k={k}"] = make_speculator(spec, engine, False)
        print(f"draft k={k}: draft step measured at {configs[f'draft k={k}'].draft_cost:.2f} of a target step")
    row_cost = next(s for s in configs.values() if s is not None).row_cost
    groups = {"copy": COPY_PROMPTS, "free": FREE_PROMPTS}
    batches = {g: [[llm.chat_prompt([{"role": "user", "content": p}]) for p in ps[i : i + args.batch]] for i in range(0, len(ps), args.batch)]
               for g, ps in groups.items()}
    reference: dict[tuple[str, int], list[list[int]]] = {}
    rates: dict[tuple[str, str], list[float]] = {}
    speedups: dict[tuple[str, str], list[float]] = {}
    counts: dict[tuple[str, str], list[int]] = {}  # drafted, accepted
    tokens_per_round: dict[str, int] = {}
    for r in range(args.rounds):
        for group, group_batches in batches.items():
            tokens = dict.fromkeys(configs, 0)
            seconds = dict.fromkeys(configs, 0.0)
            for i, prompts in enumerate(group_batches):
                # every configuration on this batch back to back, in alternating order: the machine's
                # drift between them stays small
                for name in list(configs) if (r + i) % 2 == 0 else list(reversed(configs)):
                    engine.speculator = spec = configs[name]
                    before = (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)
                    engine.blocks.reset_prefix_cache()
                    outputs, n, sec = decode(llm, prompts, params)
                    tokens[name] += n
                    seconds[name] += sec
                    if reference.setdefault((group, i), outputs) != outputs:
                        raise SystemExit(f"{name} changed the greedy output of {group} batch {i}")
                    if spec is not None:
                        c = counts.setdefault((group, name), [0, 0])
                        c[0] += spec.num_draft_tokens - before[0]
                        c[1] += spec.num_accepted_tokens - before[1]
            tokens_per_round[group] = tokens["plain"]
            for name in configs:
                rates.setdefault((group, name), []).append(tokens[name] / seconds[name])
                speedups.setdefault((group, name), []).append(tokens[name] / seconds[name] / (tokens["plain"] / seconds["plain"]))
    engine.speculator = None
    print(f"model {engine.model_path or 'in memory'}, batch {args.batch}, greedy, {args.rounds} rounds (median); "
          f"a verify row costs {row_cost:.2f} of a decode step (measured)")
    for group in groups:
        print(f"{group} text: {len(groups[group])} prompts, {tokens_per_round[group]} tokens a round")
        for name in configs:
            med = statistics.median(speedups[(group, name)])
            line = f"  {name:12s} {statistics.median(rates[(group, name)]):7.1f} tok/s  {med:.3f}x plain"
            if name != "plain":
                drafted, accepted = counts[(group, name)]
                line += f"  (rounds {', '.join(f'{x:.3f}' for x in speedups[(group, name)])}); drafts accepted {accepted}/{drafted}"
                line += f" = {accepted / max(1, drafted):.0%}"
            print(line)
    for name, spec in configs.items():
        if spec is not None and spec.measured_cost:
            print(f"{name}: draft step {spec.draft_cost:.2f} of a target step at the end (measured at start: {spec.measured_cost:.2f})")
    print("every output identical to plain decoding's")


if __name__ == "__main__":
    main()
