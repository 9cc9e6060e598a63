"""Where a GPU decode step's time goes: the host's share, the graph's kernels, the gaps between them.

    python benchmarks/gpu_profile.py [--out profile.json] [--quick]

For each case (model shapes, weights, batch), through the engine as benchmarks/gpu.py runs it:
- step: the wall time of LLMEngine.step() (host work + graph replay + reading the sampled ids),
  with steps chained (the next launched before the last one's ids are read: the default) and not;
- replay: the device time of back-to-back replays of the step's captured graph (no host work);
- host: the wall time of LLMEngine.step() with the replay made a no-op (the host's work alone);
- kernels: the kernels one replay runs (torch.profiler over replays), their summed device time
  and the top kernels by time; replay minus their sum is the graph's launch gaps.
For a prefill case (a new prompt of n tokens each step, no prefix cache): the step's wall time and
its kernels, eager (where a W8A8 prefill's time goes beside its int8 GEMMs).
Then the decode GEMVs of the shapes, split-K or not (programs_per_sm=0: no split, no reduce)."""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gpu as bench  # noqa: E402  (benchmarks/gpu.py: the models and shapes)

from fasterllama import SamplingParams  # noqa: E402
from fasterllama.engine.llm_engine import LLMEngine  # noqa: E402


def _engine(model, cfg, batch: int, ctx: int, steps: int) -> tuple[LLMEngine, list]:
    engine = LLMEngine.from_model(model, max_model_len=ctx + steps + 64, max_num_seqs=batch, max_num_batched_tokens=max(2048, ctx))
    params = SamplingParams(temperature=0, max_tokens=steps + 48, ignore_eos=True)
    seqs = [engine.add_request(bench.prompt(ctx, cfg.vocab_size, i), params) for i in range(batch)]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine, seqs


def _median_wall(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _kernels(fn, reps: int = 3, top: int = 14) -> dict:
    """The CUDA kernels fn() runs: count and summed device time per call, the top ones by time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if ev.count and t:
            kernels[ev.key] = (ev.count / reps, t / reps)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {"count": sum(c for c, _ in kernels.values()), "us": sum(t for _, t in kernels.values()), "top": {k[:90]: {"count": c, "us": round(t, 1)} for k, (c, t) in ranked}}


def profile_case(model, cfg, batch: int, ctx: int) -> dict:
    steps = 24
    engine, _ = _engine(model, cfg, batch, ctx, 3 * steps)
    plan = engine.runner.decode_plan
    bucket = next(b for b in plan.buckets if b >= batch)
    graph, out = plan.graphs[bucket]
    res: dict = {"step_us": 1e6 * _median_wall(engine.step, steps)}
    engine.chain_steps = False  # each step launched only once the last one's tokens are read
    res["step_unchained_us"] = 1e6 * _median_wall(engine.step, steps)
    engine.chain_steps = True
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    res["replay_us"] = 1e3 * start.elapsed_time(end) / steps

    def replay_and_wait() -> None:
        graph.replay()
        torch.cuda.synchronize()

    res["replay_and_wait_us"] = 1e6 * _median_wall(replay_and_wait, steps)  # one replay's launch, run and sync latency
    plan.graphs[bucket] = (types.SimpleNamespace(replay=lambda: None), out)
    res["host_us"] = 1e6 * _median_wall(engine.step, steps)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, function): (calls, primitive calls, tottime, cumtime, callers)}
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    res["host_top_us_per_step"] = {f"{os.path.basename(f)}:{line}:{fn}": round(1e6 * v[2] / steps, 1) for (f, line, fn), v in ranked}
    plan.graphs[bucket] = (graph, out)
    res["graph"] = _kernels(graph.replay)
    meta = plan._meta(bucket)  # the same kernels launched one by one (if the profiler misses graph nodes)
    res["eager"] = _kernels(lambda: plan._forward(bucket, meta))
    del engine
    return res


def profile_prefill(model, cfg, n: int) -> dict:
    """One n-token prefill step (a new prompt each time, so no prefix cache serves it): its median
    wall time, the kernels it runs, and the host's side: the time from the step's start until the
    forward pass has been launched (enqueued_us; near step_us, the host is what the step waits
    for: on 2026-11-30 a W8A8 step's kernels took 29 ms of its 41 without programmatic launch)
    and where the host's time goes (cProfile, µs a step)."""
    engine = LLMEngine.from_model(model, max_model_len=n + 8, max_num_seqs=1, max_num_batched_tokens=n, enable_prefix_caching=False)
    prompts = iter(range(10**6))
    marks: list[float] = []
    forward = engine.runner._forward

    def timed_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        marks.append(time.perf_counter())  # (launched; the step reads its token after)
        return out

    engine.runner._forward = timed_forward

    def step() -> None:
        engine.add_request(bench.prompt(n, cfg.vocab_size, 99 + next(prompts)), SamplingParams(temperature=0, max_tokens=1))
        marks.append(time.perf_counter())
        engine.step()  # (reads the sampled token: synchronized)

    step()
    res = {"step_us": 1e6 * _median_wall(step, 5)}
    res["enqueued_us"] = 1e6 * statistics.median(b - a for a, b in zip(marks[2::2], marks[3::2]))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:16]
    res["host_top_us_per_step"] = {f"{os.path.basename(f)}:{line}:{fn}": round(1e6 * v[2] / 2, 1) for (f, line, fn), v in ranked}
    res["kernels"] = _kernels(step, reps=2, top=16)
    return res


def gemv_splits(cfg, device) -> dict:
    from fasterllama.backends.cuda import gemv

    shapes = {
        "qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
        "o": (cfg.hidden_size, cfg.q_size),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, cfg.hidden_size),
    }
    out = {}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, dtype=torch.bfloat16, device=device) * 0.02
        x = torch.randn(1, K, dtype=torch.bfloat16, device=device)
        row = {"cublas": gemv._time(lambda x=x, w=w: torch.nn.functional.linear(x, w))}
        for c in (*gemv.CONFIGS, gemv.Config(32, 512, 8, 0), gemv.Config(16, 512, 4, 0), gemv.Config(8, 1024, 4, 0), gemv.Config(8, 256, 4, 0)):
            row[str(tuple(c))] = gemv._time(lambda c=c, x=x, w=w: gemv.float_gemv(x, w, cfg=c))
        out[f"{name} {N}x{K}"] = {k: round(v * 1e3, 2) for k, v in row.items()}  # us
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_profile.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    args = ap.parse_args()
    device = torch.device("cuda")
    big, small = (bench.TINY, bench.TINY) if args.quick else (bench.LLAMA2_7B, bench.SMOLLM2_135M)
    ctx = 32 if args.quick else 512
    cases = [
        ("small bf16 b1", small, None, 1),
        ("small bf16 b16", small, None, 16),
        ("7b bf16 b1", big, None, 1),
        ("7b bf16 b64", big, None, 64),
        ("7b bf16 prefill", big, None, 0),  # batch 0: a prefill case (a prompt of `prefill` tokens)
        ("7b w4-g32-sym b1", big, "w4-g32-sym", 1),  # Q4_0-like (the 4-bit row)
        ("7b w4-g32 b1", big, "w4-g32", 1),
        ("7b w8-g32 b1", big, "w8-g32", 1),
        ("7b w4-g32-sym+a8 b1", big, "w4-g32-sym+a8", 1),  # x rounded to int8 as "gguf-a8": the integer GEMVs (gemv_a8.py)
        ("7b w8a8 prefill", big, "w8a8-nosq", 0),
    ]
    prefill = 64 if args.quick else 2048
    if args.cases:
        cases = [c for c in cases if c[0] in args.cases.split(",")]
    res: dict = {"device": torch.cuda.get_device_name(), "errors": [], "pdl": bench.pdl_on(device)}
    models: dict = {}
    t0 = time.perf_counter()
    for name, cfg, mode, batch in cases:
        try:
            key = (id(cfg), mode)
            if key not in models:
                models.clear()
                torch.cuda.empty_cache()
                models[key] = bench.build(cfg, mode, device)
            if batch == 0:
                r = res[name] = profile_prefill(models[key], cfg, prefill)
                print(f"[{time.perf_counter() - t0:5.1f}s] {name}: step {r['step_us']:.0f} us (launched after {r['enqueued_us']:.0f}), "
                      f"{r['kernels']['count']:.0f} kernels {r['kernels']['us']:.0f} us", flush=True)
                continue
            res[name] = profile_case(models[key], cfg, batch, ctx)
            r = res[name]
            print(
                f"[{time.perf_counter() - t0:5.1f}s] {name}: step {r['step_us']:.0f} us (unchained {r['step_unchained_us']:.0f}), replay {r['replay_us']:.0f} "
                f"(alone {r['replay_and_wait_us']:.0f}), host {r['host_us']:.0f}, "
                f"graph {r['graph']['count']:.0f} kernels {r['graph']['us']:.0f} us, eager {r['eager']['count']:.0f} kernels {r['eager']['us']:.0f} us",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 -- keep the other cases
            res["errors"].append(f"{name}: {type(e).__name__}: {e}")
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    models.clear()
    for key, cfg in (("small", small), ("7b", big)):
        try:
            res[f"gemv {key}"] = gemv_splits(cfg, device)
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"gemv {key}: {type(e).__name__}: {e}")
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k.startswith("gemv") or k == "errors"}, indent=0))
    for name, *_ in cases:
        if name in res:
            print(name, json.dumps((res[name].get("eager") or res[name]["kernels"])["top"]))


if __name__ == "__main__":
    main()
