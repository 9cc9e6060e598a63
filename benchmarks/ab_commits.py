"""End-to-end speed of two commits in ONE process: each commit's `fasterllama` package is extracted
under its own name, both load the default model, and their measurements alternate round by round,
so the drift of a shared machine hits both alike (separate processes on this VM differ by 30%).

    python benchmarks/ab_commits.py BASE [HEAD] [--rounds 10] [--model FILE] [--only "decode b1"]

BASE, HEAD: git revisions (HEAD defaults to the working tree). Measures prefill (128, 512 and
2,000 tokens), decode at batch 1 and 8 after 128-token prompts, and decode at batch 1 and 4 after
2,000-token prompts (--only: those whose names start with one of the comma-separated prefixes);
prints each commit's weight bytes as loaded, its median and the median of the per-round ratios.
Both commits are timed by the working tree's fasterllama/bench.py (a change to how it counts is
not a change of speed)."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def extract(rev: str | None, into: Path, name: str) -> str:
    """The package of git revision `rev` (None: the working tree) as the importable module `name`."""
    dest = into / name
    if rev is None:
        shutil.copytree(ROOT / "fasterllama", dest, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "fasterllama"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        (into / "fasterllama").rename(dest)
    shutil.copy(ROOT / "fasterllama" / "bench.py", dest / "bench.py")  # one measurement for both (each with its own package's classes)
    return name


def measurements(pkg: Any, bench: Any) -> dict[str, Callable[[Any], float]]:
    ids = bench.fixed_prompt_ids

    def batch_prefill(llm: Any, n: int, b: int) -> float:
        engine = llm.engine
        engine.blocks.reset_prefix_cache() if hasattr(engine, "blocks") else None
        params = pkg.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for i in range(b):
            engine.add_request(ids(n, llm.config.vocab_size, seed=i), params)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return b * n / (time.perf_counter() - t)

    def v(llm: Any) -> int:
        return llm.config.vocab_size

    return {
        "prefill 128": lambda llm: 128 / bench._prefill_seconds(llm, ids(128, v(llm))),
        "prefill 512": lambda llm: 512 / bench._prefill_seconds(llm, ids(512, v(llm))),
        "prefill 2000": lambda llm: 2000 / bench._prefill_seconds(llm, ids(2000, v(llm))),
        "prefill 8 x 128": lambda llm: batch_prefill(llm, 128, 8),
        "decode b1, 128-token prompt": lambda llm: bench._decode_rate(llm, [ids(128, v(llm))], 64),
        "decode b8, 128-token prompts": lambda llm: bench._decode_rate(llm, [ids(128, v(llm), seed=i) for i in range(8)], 32),
        "decode b1, 2000-token prompt": lambda llm: bench._decode_rate(llm, [ids(2000, v(llm))], 32),
        "decode b4, 2000-token prompts": lambda llm: bench._decode_rate(llm, [ids(2000, v(llm), seed=i) for i in range(4)], 16),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default=None)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--model", default=None, help="model path or name (default: the default model)")
    ap.add_argument("--only", default=None, help="comma-separated prefixes of the measurements to run")
    args = ap.parse_args()
    os.environ.setdefault("FASTERLLAMA_CORE_SHARING", "0")  # a fixed thread count for both
    tmp = Path(tempfile.mkdtemp(prefix="fl_ab_"))
    try:
        sys.path.insert(0, str(tmp))
        engines, sizes = {}, {}
        for label, rev in (("base", args.base), ("head", args.head)):
            pkg = importlib.import_module(extract(rev, tmp, f"fl_{label}"))
            bench = importlib.import_module(f"fl_{label}.bench")
            llm = pkg.LLM(args.model, progress=False)
            engines[label] = (llm, measurements(pkg, bench))
            sizes[label] = importlib.import_module(f"fl_{label}.quant").weight_bytes(llm.engine.model)
        prefixes = tuple(args.only.split(",")) if args.only else ("",)
        names = [n for n in engines["base"][1] if n.startswith(prefixes)]
        for llm, tests in engines.values():  # warm-up
            for name in names:
                tests[name](llm)
        results: dict[str, dict[str, list[float]]] = {name: {"base": [], "head": []} for name in names}
        for r in range(args.rounds):
            for name in names:
                for label in ("base", "head") if r % 2 == 0 else ("head", "base"):
                    llm, tests = engines[label]
                    results[name][label].append(tests[name](llm))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    head = args.head or "working tree"
    print(f"\n{time.strftime('%Y-%m-%d')}  base {args.base}, head {head}, {args.rounds} rounds, tok/s")
    print(f"command: python benchmarks/ab_commits.py {' '.join(sys.argv[1:])}\n")
    print("| measurement | base | head | head / base (median of rounds) | range |\n|---|---:|---:|---:|---|")
    print(f"| weight bytes as loaded (MB) | {sizes['base'] / 1e6:.1f} | {sizes['head'] / 1e6:.1f} | {sizes['head'] / sizes['base']:.3f} | |")
    for name, d in results.items():
        ratios = [h / b for h, b in zip(d["head"], d["base"])]
        print(f"| {name} | {statistics.median(d['base']):.1f} | {statistics.median(d['head']):.1f} | {statistics.median(ratios):.3f} "
              f"| {min(ratios):.3f}-{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
