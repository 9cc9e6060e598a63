"""The decode GEMVs a 7B layer's qkv and gate_up projections take at batch 1 (bf16, 4-bit w4-g32-sym,
4-bit with x rounded to int8 as "gguf-a8", int8 w8-g32), each the kernel and config tune() chose,
launched eagerly between cudaProfilerStart and Stop for Nsight Compute: why the quantized GEMVs stop
at 47-66% of the copy bandwidth where bf16's reach ~99% (docs/gpu.md). Under ncu:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats python3 benchmarks/gpu_ncu.py

(An NVTX range filter, tried on 2026-11-30, let ncu profile the quantization's and tune()'s kernels
outside the range too, and its 80 s ran out there.)

Without ncu it prints each call's time (µs, CUDA events over 50 calls: a check that it runs)."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gpu as bench  # noqa: E402  (benchmarks/gpu.py: the models and shapes)

from fasterllama.backends import get_backend  # noqa: E402


def main() -> None:
    quick = "--quick" in sys.argv
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (the CPU: --quick, the script's check)
    cfg = dataclasses.replace(bench.TINY if quick else bench.LLAMA2_7B, num_layers=1)
    for mode in (None, "w4-g32-sym", "w4-g32-sym+a8", "w8-g32"):
        model = bench.build(cfg, mode, device)
        get_backend(device).prepare_model(model)  # tune(): the kernel and config each shape takes
        layer = model.layers[0]
        with torch.inference_mode():
            for name, linear in (("qkv", layer.self_attn.qkv_proj), ("gate_up", layer.mlp.gate_up_proj)):
                x = torch.randn(1, linear.in_features, dtype=torch.bfloat16, device=device)
                linear(x)
                if device.type == "cpu":
                    continue
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                linear(x)
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    linear(x)
                end.record()
                end.synchronize()
                print(f"{mode or 'bf16'} {name} {linear.out_features}x{linear.in_features}: {start.elapsed_time(end) / 50 * 1e3:.1f} us a call (eager)", flush=True)
        print(mode or "bf16", "built", flush=True)
        del model


if __name__ == "__main__":
    main()
