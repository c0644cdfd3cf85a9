#!/usr/bin/env bash
# The GPU check, unattended, on one H200 with nothing fetched (about 6-7 minutes):
#   1. the correctness tests of every decoding path on CUDA (tests/test_capture.py: eager, CUDA graphs,
#      torch.compile with CUDA graphs; never/always/mixed routing, greedy and sampling, batch 1 and padded);
#   2. the speed run: random Qwen2.5-1.5B + 32B shapes in bf16, prompt 64, 128 new tokens, batch 1 (fixed
#      schedule) and 8 (rows routed independently), p = 0, 0.05, 0.1, 0.2, R2R on CUDA graphs against
#      slm/llm.generate eager and with HF's static cache + compile, warm-up times included.
# Results go to $OUT (the device tool's folder; benchmarks/results here) as they are written:
# gpu.txt, cuda_tests.log, speed_gpu.json, speed.log. Needs .whl/ (benchmarks/gpu_wheels.sh) carried along:
#   device run: command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 580
# then copy speed_gpu.json to benchmarks/results/ and run python -m benchmarks.tables speed_gpu for docs/performance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "install the carried wheels failed: run benchmarks/gpu_wheels.sh and carry .whl"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_capture.py 2>&1 | tee "$OUT/cuda_tests.log"
tests=${PIPESTATUS[0]}
timeout 400 python3 -m benchmarks.speed --slm qwen2.5-1.5b --llm qwen2.5-32b --device cuda --cache static \
    --batch-sizes 1,8 --shares 0,0.05,0.1,0.2 --per-row-from 2 --tokens 128 --prompt 64 --repeats 1 \
    --eager-shares 0.1 --eager-batches 1 --out "$OUT/speed_gpu.json" 2>&1 | tee "$OUT/speed.log"
speed=${PIPESTATUS[0]}
echo "cuda tests exit $tests, speed run exit $speed"
exit $(( tests != 0 || speed != 0 ))
