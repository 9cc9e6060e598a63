"""Tensor parallelism on this machine: prefill and decode tok/s at N = 1 and 2 ranks (the machine's
threads divided between them), rank 0's weight bytes and each rank's peak resident memory, and the collectives each decode
step makes (count and bytes). Each N runs in a fresh process, one after the other, so the peaks are
its own; on a shared machine run it twice and compare within a run.

    python benchmarks/tensor_parallel.py [--model M] [--sizes 1,2] [--json OUT]

Then a model, not a measurement, of what N GPUs over NVLink give for LLaMA-2-70B in bf16 at batch 1
(`--gpu-model`): a decode step reads each rank's 1/N of the weights at the bandwidth fraction our
7B bf16 decode reached on an H200 (docs/gpu.md) and makes 2 all-reduces of one hidden vector per
layer (latency-bound on NVLink), against gpt-fast's measured 21.3 / 38.0 / 62.5 tok/s on 2 / 4 / 8
A100s."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
from fasterllama import LLM, SamplingParams
from fasterllama.bench import run_bench, fixed_prompt_ids

args = json.loads(sys.argv[1])
if __name__ == "__main__":
    llm = LLM(args["model"], progress=False, tensor_parallel_size=args["size"], enable_prefix_caching=False)
    result = run_bench(llm, args["prompt_lens"], args["batch_sizes"], args["decode_steps"], args["repeats"])
    engine, group = llm.engine, llm.engine.tp_group
    if group is not None:  # one more decode at batch 1, counting its collectives
        group.traffic.clear()
        steps = 32
        llm.generate([fixed_prompt_ids(16, llm.config.vocab_size)], SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        total = steps + 1  # steps: the prefill and each decode token
        result["collectives_per_step"] = {k: {"calls": c / total, "bytes": b / total} for k, (c, b) in group.traffic.items()}
    peaks = [result["peak_rss_mb"]]
    for p in (engine._workers.processes if engine._workers else []):
        with open(f"/proc/{p.pid}/status") as f:
            peaks.append(next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM")))
    result["peak_rss_mb_per_rank"] = peaks
    seen, weight_bytes = set(), 0  # rank 0's weights: its part of them
    for t in list(engine.model.parameters()) + list(engine.model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weight_bytes += t.numel() * t.element_size()
    result["rank0_weights_mb"] = weight_bytes / 2**20
    engine.shutdown()
    print("RESULT " + json.dumps(result))
"""

LATENCY = """
import json, sys, time, torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fasterllama.parallel.group import Rendezvous, TPGroup

def rank(r, port, floats, store=None):
    torch.set_num_threads(1)
    group = TPGroup(r, 2, Rendezvous("127.0.0.1", port, 60), torch.device("cpu"), store)
    t = torch.ones(floats)
    out = {}
    for name, op in (("gloo allreduce", lambda: group.data.allreduce([t]).wait()),
                     ("send/recv exchange (TPGroup.all_reduce)", lambda: group.all_reduce(t))):
        for _ in range(50):
            op()
        start = time.perf_counter()
        for _ in range(1000):
            op()
        out[name] = (time.perf_counter() - start) / 1000 * 1e6
    return out

if __name__ == "__main__":
    floats = int(sys.argv[1])
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    peer = mp.get_context("spawn").Process(target=rank, args=(1, store.port, floats))
    peer.start()
    out = rank(0, store.port, floats, store)
    peer.join()
    print("RESULT " + json.dumps(out))
"""


# LLaMA-2-70B: 80 layers, hidden 8192, bf16 weights
LLAMA70B = {"bytes": 68.98e9 * 2, "layers": 80, "hidden": 8192}
A100 = {"name": "A100-80GB SXM", "bandwidth": 2.039e12}
GPT_FAST_70B = {2: 21.3, 4: 38.0, 8: 62.5}  # tok/s, LLaMA-2-70B bf16, gpt-fast's README (A100s)


def gpu_model(bandwidth_fraction: float = 0.65, all_reduce_us: float = 12.0) -> list[dict]:
    """tok/s at batch 1 for N = 2, 4, 8: weights/N over bandwidth x fraction, plus 2 all-reduces a layer."""
    rows = []
    for n, measured in GPT_FAST_70B.items():
        read = LLAMA70B["bytes"] / n / (A100["bandwidth"] * bandwidth_fraction)
        comm = 2 * LLAMA70B["layers"] * all_reduce_us * 1e-6
        rows.append({"gpus": n, "model_tok_s": 1 / (read + comm), "weights_ms": read * 1e3, "all_reduce_ms": comm * 1e3,
                     "gpt_fast_tok_s": measured})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--prompt-lens", default="128,512")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--latency", type=int, default=576, help="also time one all-reduce of this many floats between two processes (0: skip)")
    args = ap.parse_args()
    results = {}
    if args.latency:
        with tempfile.TemporaryDirectory() as tmp:  # a file: the spawned peer imports its function from it
            script = os.path.join(tmp, "tp_latency.py")
            with open(script, "w") as f:
                f.write(LATENCY)
            proc = subprocess.run([sys.executable, script, str(args.latency)], capture_output=True, text=True, timeout=300)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"latency run failed:\n{proc.stderr[-2000:]}")
        latency = json.loads(line[7:])
        print(f"one all-reduce of {args.latency} floats between two processes, 1 thread each: "
              + ", ".join(f"{k} {v:.0f} us" for k, v in latency.items()))
        results["latency_us"] = latency
    for size in map(int, args.sizes.split(",")):
        child = {"model": args.model, "size": size, "prompt_lens": [int(x) for x in args.prompt_lens.split(",")],
                 "batch_sizes": [int(x) for x in args.batch_sizes.split(",")], "decode_steps": args.decode_steps, "repeats": args.repeats}
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(child)], capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"N={size} failed:\n{proc.stderr[-3000:]}")
        results[size] = json.loads(line[7:])
    prompt_lens, batches = args.prompt_lens.split(","), args.batch_sizes.split(",")  # (the columns measured)
    print(f"{'N':>3} " + " ".join(f"{'prefill ' + k:>12}" for k in prompt_lens) + " " + " ".join(f"{'decode b' + k:>10}" for k in batches)
          + "  rank 0 weights MiB  peak MiB per rank")
    for size, r in ((k, v) for k, v in results.items() if k != "latency_us"):
        pre, thr = r["prefill"], r["throughput_tokens_per_s"]
        cells = [f"{pre[k]['tokens_per_s']:12.1f}" if k in pre else f"{'':>12}" for k in prompt_lens]
        cells += [f"{thr[k]:10.1f}" if k in thr else f"{'':>10}" for k in batches]
        print(f"{size:>3} {' '.join(cells)}  {r['rank0_weights_mb']:17.1f}  {', '.join(f'{m:.0f}' for m in r['peak_rss_mb_per_rank'])}")
        for name, c in r.get("collectives_per_step", {}).items():
            print(f"      {name}: {c['calls']:.0f} calls, {c['bytes'] / 1024:.1f} KiB per step (rank 0 sends)")
    print("\nLLaMA-2-70B bf16, batch 1, a model of N A100s over NVLink (65% of 2.04 TB/s, 12 us per all-reduce):")
    model = gpu_model()
    for row in model:
        print(f"  {row['gpus']} GPUs: {row['model_tok_s']:.1f} tok/s ({row['weights_ms']:.1f} ms weights + {row['all_reduce_ms']:.1f} ms "
              f"all-reduces); gpt-fast measured {row['gpt_fast_tok_s']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "gpu_model_70b": model}, f, indent=1)


if __name__ == "__main__":
    main()
