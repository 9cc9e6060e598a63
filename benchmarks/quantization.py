"""Every quantization mode on the default model: perplexity on license texts that every Debian
machine has (no downloads), resident weight bytes, and decode / prefill speed, in one run.

    python benchmarks/quantization.py [--max-tokens 20480] [--modes none,w8,...] [--json out.json] [--no-ppl]

Calibration (static w8a8, SmoothQuant) uses the Apache-2.0 text, which is not in the eval text."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from fasterllama import LLM, SamplingParams
from fasterllama.evaluate import perplexity
from fasterllama.quant import weight_bytes

LICENSES = "/usr/share/common-licenses"
EVAL_FILES = ["GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-2.0"]
CALIBRATION_FILE = "Apache-2.0"
MODES = [
    "none", "w8", "w8-g32", "w4-g32", "w4-g64", "w4-g128", "w8a8-nosq", "w8a8",
    "w8a8-static-percentile99.99", "w8a8-static-max", "w8a8-static-mse", "w8a8-static-entropy",
    "w8a8-static-percentile99.99-clip", "w8a8-static-max-clip", "gguf",
]


def read(name: str) -> str:
    with open(os.path.join(LICENSES, name), encoding="utf-8", errors="replace") as fh:
        return fh.read()


def speed(llm: LLM, prompt_ids: list[int]) -> tuple[float, float]:
    """(prefill tok/s over the prompt, decode tok/s over 64 greedy steps), best of 2."""
    pre, dec = [], []
    for _ in range(2):
        t = time.perf_counter()
        llm.compute_logits(prompt_ids)
        pre.append(len(prompt_ids) / (time.perf_counter() - t))
        params = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
        seq = llm.engine.add_request(prompt_ids[:16], params)
        llm.engine.step()  # prefill + first token
        t = time.perf_counter()
        while not seq.is_finished:
            llm.engine.step()
        dec.append(64 / (time.perf_counter() - t))
    return max(pre), max(dec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=20480)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-ppl", action="store_true", help="speed and memory only")
    ap.add_argument("--eval-files", default=",".join(EVAL_FILES), help=f"texts from {LICENSES} to score (default: the eval set)")
    args = ap.parse_args()
    eval_files = args.eval_files.split(",")
    text = "\n\n".join(read(f) for f in eval_files)
    calibration = read(CALIBRATION_FILE)
    rows = []
    base_ppl = base_bytes = None
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        llm = LLM(args.model, quantization=mode, calibration_text=calibration, progress=False)
        load = time.perf_counter() - t0
        ids = llm.tokenizer.encode(text)[: args.max_tokens]
        result = {"perplexity": float("nan"), "tokens": 0} if args.no_ppl else perplexity(llm, ids, args.context, args.context // 2, progress=False)
        wb = weight_bytes(llm.engine.model)
        prefill, decode = speed(llm, ids[:128])
        if mode == "none":
            base_ppl, base_bytes = result["perplexity"], wb
        row = dict(mode=mode, ppl=result["perplexity"], tokens=result["tokens"], weight_mb=wb / 1e6, load_s=load,
                   prefill_tok_s=prefill, decode_tok_s=decode)
        if base_ppl:
            row.update(ppl_delta_pct=100 * (row["ppl"] / base_ppl - 1), weight_pct=100 * wb / base_bytes)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
        gc.collect()
    base = rows[0]
    print("\n| mode | perplexity | vs fp32 | weights MB | % of fp32 | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ppl']:.3f} | {r.get('ppl_delta_pct', 0):+.2f}% | {r['weight_mb']:.0f} | {r.get('weight_pct', 100):.1f}% "
              f"| {r['prefill_tok_s']:.0f} ({r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x) | {r['decode_tok_s']:.1f} ({r['decode_tok_s'] / base['decode_tok_s']:.2f}x) |")
    print(f"\n{rows[0]['tokens']} tokens of {', '.join(eval_files)}; context {args.context}, stride {args.context // 2}; torch threads {torch.get_num_threads()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
