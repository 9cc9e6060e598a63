"""Write a HF checkpoint folder with random weights at a real model's shapes, for speed
measurements where the real file cannot go (the GPU machine takes no files over 64 MiB and
reaches no hub). Its speed is the real model's; its text is noise.

    python benchmarks/random_checkpoint.py OUT_DIR [--layers 30] [--vocab 49152]

Shapes default to SmolLM2-135M (hidden 576, 9 query / 3 KV heads, intermediate 1536, tied
embeddings). The tokenizer is the tests' small byte-level BPE: token ids above its vocabulary
are valid model inputs (the benchmarks feed fixed token ids), they just decode to nothing."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import tiny_models as tm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    spec = tm.TinySpec(
        "smollm2-135m-shapes", vocab_size=args.vocab, hidden_size=576, intermediate_size=1536, num_layers=args.layers,
        num_heads=9, num_kv_heads=3, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
        initializer_range=0.02,
    )
    model = tm.build_hf_model(spec)
    model.save_pretrained(args.out)
    tm.save_tokenizer(args.out, min(args.vocab, 3 + 256 + 23 * 23))
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M random parameters")


if __name__ == "__main__":
    main()
