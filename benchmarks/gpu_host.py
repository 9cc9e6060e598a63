"""The CUDA backend's host cost of an eager step (prompts, mixed steps: what CUDA graphs do not
replay), measured without a GPU: the CUDA backend's ops run on CPU tensors with every Triton launch
a no-op, so what is timed is the launchers' Python, torch's allocations and the engine's step
around them; Triton's own launcher and the kernels are not in it. A 32-layer model at a tiny width
(the 7B's launches, little tensor work), CPU time per step (process_time, one torch thread: the
time of a shared machine's other tenants is not counted).

    python benchmarks/gpu_host.py [--base REV] [--rounds 3] [--modes w8a8-nosq,w4-g32-sym] [--tokens 16,2048]

--base: also time git revision REV's package, alternating with the working tree's round by round
(separate processes), and print the per-round ratios."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(mode: str, tokens: int, steps: int) -> dict:
    """{launches, ms}: the median CPU time of an engine step that prefills a `tokens`-token prompt."""
    import time

    import torch
    from triton.runtime import jit

    launches = [0]

    def no_launch(self, *args, **kwargs) -> None:
        launches[0] += 1

    jit.JITFunction.run = no_launch
    from fasterllama import SamplingParams, ops  # (first: the package on PYTHONPATH, before gpu.py puts the working tree's on the path)
    from fasterllama.backends.cuda import CUDABackend, kernel_ops
    from fasterllama.config import ModelConfig
    from fasterllama.engine import llm_engine

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu  # the benchmark's model builder

    class OnCPU(CUDABackend):
        def register_ops(self) -> None:
            for name, fn in kernel_ops().items():
                ops.register("cpu", name, fn)
            self.kernels = True

    ops._BACKENDS["cpu"] = {}
    llm_engine.get_backend = OnCPU
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=32, num_heads=4, num_kv_heads=4, head_dim=32)
    model = gpu.build(cfg, None if mode == "bf16" else mode, torch.device("cpu"))
    engine = llm_engine.LLMEngine.from_model(model, max_model_len=tokens + 8, max_num_seqs=1, max_num_batched_tokens=tokens,
                                             enable_prefix_caching=False)
    times = []
    for rep in range(steps + 3):
        engine.add_request(gpu.prompt(tokens, cfg.vocab_size, rep), SamplingParams(temperature=0, max_tokens=1))
        launches[0] = 0
        t = time.process_time()
        engine.step()
        times.append(time.process_time() - t)
        while engine.has_unfinished():
            engine.step()
    return {"launches": launches[0], "ms": statistics.median(times[3:]) * 1e3, "package": ops.__file__}


def run(package_dir: Path, mode: str, tokens: int, steps: int) -> dict:
    """measure() in a fresh process importing fasterllama from package_dir."""
    env = {**os.environ, "PYTHONPATH": str(package_dir), "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(tokens), str(steps)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="a git revision to compare with the working tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="w8a8-nosq,w4-g32-sym")  # (bf16: its linears are torch matmuls, run here on the CPU)
    ap.add_argument("--tokens", default="16,2048")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, tokens, steps = args.child
        print(json.dumps(measure(mode, int(tokens), int(steps))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"head": ROOT}
        if args.base:
            from ab_commits import extract  # (this folder's: git archive of the revision's package)

            extract(args.base, Path(tmp), "fasterllama")
            trees["base"] = Path(tmp)
        for mode in args.modes.split(","):
            for tokens in map(int, args.tokens.split(",")):
                got = {name: [] for name in trees}
                for _ in range(args.rounds):
                    for name, tree in trees.items():
                        got[name].append(run(tree, mode, tokens, args.steps))
                assert all(r["package"].startswith(str(trees[name])) for name, rs in got.items() for r in rs), "a package imported from elsewhere"
                line = f"{mode:>10} {tokens:>5} tokens: {got['head'][0]['launches']} launches"
                for name, rs in got.items():
                    ms = statistics.median(r["ms"] for r in rs)
                    line += f" | {name} {ms:.2f} ms a step, {ms * 1e3 / rs[0]['launches']:.1f} us a launch"
                if "base" in got:
                    ratios = [h["ms"] / b["ms"] for h, b in zip(got["head"], got["base"])]
                    line += f" | head/base {statistics.median(ratios):.3f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
