#!/usr/bin/env bash
# The GPU checks for a session lent a GPU machine (device tool): the CUDA tests, then
# `fasterllama bench` on random weights at SmolLM2-135M's shapes (the real file cannot travel)
# in bf16 and fp32. Logs and JSON land in $OUT (default ./cuda_out). Wheels in .whl/ (gguf, which
# that machine lacks) are installed first when present.
#     bash benchmarks/cuda_check.sh
set -uo pipefail
OUT=${OUT:-cuda_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
python3 benchmarks/random_checkpoint.py /tmp/smollm2-shapes 2>&1 | tail -1
for dtype in bfloat16 float32; do
    timeout 150 python3 -m fasterllama bench --model /tmp/smollm2-shapes --device cuda --dtype $dtype --batch-sizes 1,8,16 \
        --repeats 2 --json "$OUT/bench_cuda_$dtype.json" 2>&1 | sed "s/.*\r//" | tee "$OUT/bench_cuda_$dtype.log"
done
