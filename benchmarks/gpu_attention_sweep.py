"""Decode attention (backends/cuda/triton_attention.py: the split kernel + its combine) over its tile
and split choices: µs a call, launched from a CUDA graph as decode steps launch it, at LLaMA-2-7B's
heads (32 MHA, head_dim 128) and the default model's (9 query / 3 KV heads, 64), bf16, batch 1 and 8,
contexts of 512 and 2,048 keys in a paged cache of twice the capacity (as the engine's: the split
count is fixed from the capacity, each split's keys follow the length). The engine's own choice is
marked; each candidate's output is checked against it. On a 7B step at batch 1 the kernel and its
combine took ~9.6 µs a layer on 11-27 where the K/V read takes ~2 (docs/gpu.md).

    python benchmarks/gpu_attention_sweep.py            # a CUDA GPU, about a minute
    TRITON_INTERPRET=1 python benchmarks/gpu_attention_sweep.py --quick   # the script's check on the CPU"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fasterllama.backends.cuda import gemv  # noqa: E402
from fasterllama.backends.cuda import triton_attention as ta  # noqa: E402

BLOCK_SIZE = 16  # the engine's KV block


def paged(batch: int, kvh: int, d: int, ctx: int, capacity: int, device: str, dtype: torch.dtype):
    """(k_cache, v_cache, block tables, lengths): each sequence ctx keys in its own shuffled blocks."""
    per = triton.cdiv(capacity, BLOCK_SIZE)
    g = torch.Generator(device="cpu").manual_seed(0)
    tables = torch.randperm(batch * per, generator=g).view(batch, per).to(torch.int32).to(device)
    k = torch.randn(batch * per, kvh, BLOCK_SIZE, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(batch * per, kvh, BLOCK_SIZE, d, generator=g).to(device=device, dtype=dtype)
    return k, v, tables, torch.full((batch,), ctx, dtype=torch.int32, device=device)


def sweep(name: str, h: int, kvh: int, d: int, batch: int, ctx: int, device: str, dtype: torch.dtype, quick: bool) -> None:
    """One shape: every (keys a tile, splits) candidate's µs a call and its difference from the engine's choice."""
    capacity = 2 * ctx
    k, v, tables, lens = paged(batch, kvh, d, ctx, capacity, device, dtype)
    q = torch.randn(batch, h, d, device=device).to(dtype)

    def call(block_n: int | None = None, splits: int | None = None) -> torch.Tensor:
        return ta.decode_attention(q, k, v, tables, lens, d**-0.5, capacity, block_n, splits)

    def timed(fn) -> float:
        if quick:  # (the interpreter: one call's wall time)
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return gemv._time(fn)

    want = call()
    chosen_block = ta._decode_block_n(ta._block_d(d), True, dtype, batch * kvh, q.device)
    chosen = (chosen_block, ta._decode_splits(batch, kvh, capacity, chosen_block, q.device))
    blocks = (16, 32) if quick else (32, 64, 128)
    grid = {(bn, ns) for bn in blocks for ns in (1, 2, 4, 8, 16, 32, 64) if ns <= triton.cdiv(capacity, bn) and bn * d <= 16384}
    for bn, ns in sorted(grid | {chosen}):
        err = (call(bn, ns).float() - want.float()).abs().max().item()
        us = timed(lambda bn=bn, ns=ns: call(bn, ns)) * 1e3
        mark = "  <- the engine's" if (bn, ns) == chosen else ""
        print(f"{name} heads {h}/{kvh} d {d}  batch {batch:2d}  ctx {ctx:5d}  block_n {bn:3d}  splits {ns:2d}: {us:8.1f} us  max diff {err:.1e}{mark}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1 (a check, not a timing)")
    args = ap.parse_args()
    device, dtype = ("cpu", torch.float32) if args.quick else ("cuda", torch.bfloat16)
    shapes = [("tiny", 4, 2, 32)] if args.quick else [("7b", 32, 32, 128), ("default", 9, 3, 64)]
    for name, h, kvh, d in shapes:
        for batch in (1, 2) if args.quick else (1, 8):
            for ctx in (40,) if args.quick else (512, 2048):
                sweep(name, h, kvh, d, batch, ctx, device, dtype, args.quick)


if __name__ == "__main__":
    main()
