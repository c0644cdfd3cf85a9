#!/usr/bin/env bash
# The GPU check, unattended, on one H200 with nothing fetched; rehearsed on a CPU by CI:
#
#   bash benchmarks/gpu_check.sh            # the device run (at most ~535 s; every step has its own deadline)
#   bash benchmarks/gpu_check.sh --dry-run  # the same script on this CPU: tiny shapes, emulated graphs (~2 minutes)
#
# Device run: command "bash benchmarks/gpu_check.sh", timeout_s 540. The deadlines add up to ~535 s:
# versions ~5 s + tests 90 s + measurements 440 s (benchmarks/gpu_check.py stops itself at 420 s after its
# start; the 20 s more are its imports; its serving phase has 120 s of them). Steps, most important first; what each writes lands in $OUT:
#   1. gpu.txt          the GPU, torch and transformers (the image's own when r2r_hf supports it, else the
#                       wheels in .whl/ from benchmarks/gpu_wheels.sh, which the run must then carry)
#   2. cuda_tests.log   tests/test_capture.py on CUDA without the compile cases (those take minutes there), without
#                       -x: one failure must not hide the others
#   3. gpu_check.json   benchmarks/gpu_check.py: every phase under its own guard and budget (a phase that raises
#                       is errors[phase] and the next one runs; the order and budgets: its docstring), last the
#                       compiled llm.generate in a fresh process (log: gpu_check.log)
# GPU_CHECK_FAIL_PHASE=NAME (tests only) raises in that phase: every other phase must still write its numbers.
# Then: copy gpu_check.json to benchmarks/results/ and run python -m benchmarks.tables gpu for docs/performance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# transformers: the installed one when r2r_hf supports it (nothing carried), else the carried wheels.
if ! "$PY" -c "from r2r_hf.compat import check_transformers; check_transformers()" 2>"$OUT/versions.err"; then
    cat "$OUT/versions.err"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "the installed transformers is not supported and no wheels were carried (benchmarks/gpu_wheels.sh)"; exit 1; }
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
{ if [ $DRY = 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"

if [ "${GPU_CHECK_TESTS:-1}" = 0 ]; then  # CI: the suite has just run these tests
    echo "tests/test_capture.py: left out here (GPU_CHECK_TESTS=0)" | tee "$OUT/cuda_tests.log"; tests=0
else
    timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m "not compile" tests/test_capture.py 2>&1 | tee "$OUT/cuda_tests.log"
    tests=${PIPESTATUS[0]}
fi

# 20 s above gpu_check.py's own deadline (DRY_RUN / DEVICE.deadline_s: 360 / 420 s): this is the backstop only.
timeout $([ $DRY = 1 ] && echo 380 || echo 440) "$PY" -m benchmarks.gpu_check --out "$OUT" \
    $([ $DRY = 1 ] && echo --dry-run) 2>&1 | tee "$OUT/gpu_check.log"
check=${PIPESTATUS[0]}
echo "tests exit $tests, measurements exit $check; results in $OUT"
exit $(( tests != 0 || check != 0 ))
