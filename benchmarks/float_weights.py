"""16-bit checkpoints on the CPU: a HF folder of bf16 or fp16 safetensors loaded as stored (the
default: the C GEMVs widen each weight to fp32 in registers) against the same folder expanded to
fp32 weights (quantization="none", what every load did before), and HF transformers on the same
folder in the checkpoint's dtype. Random weights at a real model's shapes, built here (no hub);
engines alternate within each repeat, and the memory read bandwidth is measured around every
decode run (its ceiling: bandwidth / weight bytes a token reads).

    python benchmarks/float_weights.py [--shape default|1b] [--dtypes bfloat16,float16] [--repeats 3] [--skip hf] [--json FILE]

default: SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads, tied embeddings); 1b:
TinyLlama-1.1B's (22 layers, hidden 2048, 32/4 heads, 2.2 GB in bf16, 4.4 GB expanded).
The kept and expanded models give the same greedy tokens (checked here too: the widening is
exact and the sums run in the same order)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from compare_cpu import FasterLlama, HFTransformers, MachineLimits, positive

from fasterllama.bench import fixed_prompt_ids

SHAPES = {
    "default": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, tie_word_embeddings=True),
    "1b": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
               vocab_size=32000, tie_word_embeddings=False),
}


def write_folder(shape: str, dtype: torch.dtype, folder: str) -> None:
    """A LLaMA checkpoint of random weights (std 0.02, norms 1) in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))  # prompts are token ids
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(f"{folder}/tokenizer.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--threads", type=positive, default=2)
    ap.add_argument("--prompt-len", type=positive, default=128)
    ap.add_argument("--decode-steps", type=positive, default=64)
    ap.add_argument("--batch", type=positive, default=8)
    ap.add_argument("--repeats", type=positive, default=3)
    ap.add_argument("--skip", default="", help="hf: leave HF transformers out")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    machine = MachineLimits()
    result = {"date": time.strftime("%Y-%m-%d"), "shape": args.shape, "threads": args.threads, "runs": {}}
    for dtype in dtypes:
        with tempfile.TemporaryDirectory() as folder:
            write_folder(args.shape, dtype, folder)
            ours = [FasterLlama("fasterllama (default: kept as stored)", folder), FasterLlama("fasterllama fp32 (expanded)", folder, quantization="none")]
            engines = ours + ([HFTransformers(folder, dtype, f"HF transformers {str(dtype).removeprefix('torch.')}")] if "hf" not in args.skip else [])
            ids = fixed_prompt_ids(args.prompt_len, ours[0].llm.config.vocab_size)
            runs = {e.name: {"prefill": [], "decode": [], "ceiling": [], "batch": []} for e in engines}
            tokens = {}
            for e in engines:
                e.prefill(ids[:16])  # warm-up
            for rep in range(args.repeats):
                for e in engines:
                    runs[e.name]["prefill"].append(len(ids) / e.prefill(ids))
                    before = machine.read_now()
                    secs, tokens[e.name] = e.decode(ids, args.decode_steps)
                    runs[e.name]["ceiling"].append((before + machine.read_now()) / 2 * 1e9 / e.weight_bytes)
                    runs[e.name]["decode"].append(args.decode_steps / secs)
                for e in ours:
                    runs[e.name]["batch"].append(e.batch_throughput(args.prompt_len, args.batch, args.decode_steps))
                print(f"{dtype}: repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
            same = tokens[ours[0].name] == tokens[ours[1].name]
            print(f"\n{result['date']}  shape {args.shape}, {str(dtype).removeprefix('torch.')} safetensors  threads={args.threads}  "
                  f"prompt={len(ids)}  decode={args.decode_steps} greedy steps  medians of {args.repeats}; kept and expanded "
                  f"greedy tokens {'identical' if same else 'DIFFER'}")
            base = ours[1].name
            print(f"| engine | weights MB | prefill tok/s | decode b1 tok/s | of ceiling | decode b{args.batch} tok/s | b1 / fp32 | b{args.batch} / fp32 |")
            print("|---|---|---|---|---|---|---|---|")
            med = {n: {k: statistics.median(v) if v else None for k, v in r.items()} for n, r in runs.items()}
            out = result["runs"][str(dtype).removeprefix("torch.")] = {"greedy_tokens_identical": same, "engines": {}}
            for e in engines:
                m = med[e.name]
                of = statistics.median(d / c for d, c in zip(runs[e.name]["decode"], runs[e.name]["ceiling"]))
                b = f"{m['batch']:.1f}" if m["batch"] else "-"
                rb = f"{m['batch'] / med[base]['batch']:.2f}x" if m["batch"] else "-"
                print(f"| {e.name} | {e.weight_bytes / 1e6:.0f} | {m['prefill']:.0f} | {m['decode']:.1f} | {of:.0%} | {b} | "
                      f"{m['decode'] / med[base]['decode']:.2f}x | {rb} |")
                out["engines"][e.name] = {"weight_bytes": e.weight_bytes, "of_ceiling": of, **{k + "_runs": v for k, v in runs[e.name].items()}}
            del ours, engines
    result["read_gb_per_s"] = statistics.median(machine.read)
    print(f"\nmemory read bandwidth (median over the run): {result['read_gb_per_s']:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
