#!/usr/bin/env bash
# One lent-GPU session (under 10 minutes: one device call): the end-to-end CUDA tests, benchmarks/gpu.py,
# benchmarks/gpu_profile.py, then the Triton kernel tests at real shapes with the time left.
# Logs and the benchmark's JSON go to $OUT. Runs under the GPU image's python3 (torch, triton,
# transformers there); gguf, which it lacks, travels as a wheel in .whl/ (see docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
T0=$(date +%s)
# 1. the engine end to end (tiny models against HF and the CPU; graphs against eager)
timeout "${E2E_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log" | tail -25
echo "e2e tests: $(( $(date +%s) - T0 )) s"
# 2. the benchmark (its JSON is rewritten after every section)
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-230}" python3 benchmarks/gpu.py --out "$OUT/gpu_bench.json" --budget "${BUDGET:-180}" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log" | grep -E '^\[|Error|error' | tail -40
  python3 - "$OUT/gpu_bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("errors:", r.get("errors"))
for k, v in (r.get("targets") or {}).items():
    print(f"{k}: {v}")
PY
fi
echo "bench: $(( $(date +%s) - T0 )) s"
# 3. where a decode step's time goes (host, graph, kernels), for the next round of work
if [ "${PROFILE:-1}" = 1 ]; then
  timeout "${PROFILE_TIMEOUT:-50}" python3 benchmarks/gpu_profile.py --cases "small bf16 b1,7b bf16 b1,7b bf16 b64" --out "$OUT/gpu_profile.json" \
    > "$OUT/profile.log" 2>&1; grep -E '^\[|Error' "$OUT/profile.log"
fi
# 4. every Triton kernel against its reference op at real shapes, with what time is left
timeout "${KERNEL_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -rfE -x ${KERNEL_TESTS:-tests/test_triton_sampling.py tests/test_triton_gemv.py tests/test_triton_norm.py tests/test_triton_linear.py tests/test_triton_attention.py} 2>&1 \
  | tee "$OUT/test_kernels.log" | tail -15
echo "total: $(( $(date +%s) - T0 )) s"
