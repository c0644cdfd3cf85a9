#!/usr/bin/env bash
# The GPU check, unattended, on one H200 with nothing fetched; rehearsed on a CPU by CI:
#
#   bash benchmarks/gpu/check.sh            # the device run (8.5 minutes at most: every step has its own timeout)
#   bash benchmarks/gpu/check.sh --dry-run  # the same script on this CPU: tiny shapes, emulated graphs (~3 minutes)
#
# Device run: command "bash benchmarks/gpu/check.sh", timeout_s 540: 15 minutes of device time, less a start of
# 1-2 minutes, leave ~4 for one rerun of the phases that failed (check.py --phases) on the still-warm machine.
# Steps, most valuable first (in $OUT):
#   1. gpu.txt            the GPU, torch and transformers (the image's own when r2r_hf supports it, else the wheels
#                         in .whl/ from benchmarks/gpu/wheels.sh, which the run must then carry)                ~5 s
#   2. gpu_check.json     benchmarks/gpu/check.py: build, `warm` (generate's compiles), the headline pair (R2R fused
#                         at p = 0.1 and the fused LLM alone, batch 1) within 2 minutes of it, the grid's and the
#                         servers' warm-ups (every other compile), then the grid, serving, long answers, speculation
#                         with the agreement oracle, the fused 32B against eager, the SLM's kernels, the fit (its
#                         docstring: phases and budgets); each phase under its own guard: a phase that raises is
#                         errors[phase] and the next one runs; the phases stop themselves at 450 s   timeout 480 s
#   3. llm_compiled.json  benchmarks/gpu/compiled.py, the peers in a fresh process: HF's generate_batch outside
#                         inference mode, then HF's compiled llm.generate (batch 1), with what is left of 510 s (not
#                         started under 30 s); then merged into gpu_check.json (log: gpu_compiled.log)
#   4. cuda_tests.log     tests/test_capture.py on CUDA, fusing off, without the compile cases, without -x: only where
#                         60 s of the 510 are left
# GPU_CHECK_FAIL_PHASE=NAME (tests only) raises in that phase: every other phase must still write its numbers.
# Then: copy gpu_check.json to benchmarks/results/ and run python -m benchmarks.tables gpu for gpu_check.md there.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
DRYFLAG=$([ $DRY = 1 ] && echo --dry-run)
TOTAL=510 TESTS=60  # seconds: the whole script (device), the CUDA tests' step
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# 1. transformers: the installed one when r2r_hf supports it (nothing carried), else the carried wheels.
if ! "$PY" -c "from r2r_hf.compat import check_transformers; check_transformers()" 2>"$OUT/versions.err"; then
    cat "$OUT/versions.err"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "the installed transformers is not supported and no wheels were carried" \
                  "(benchmarks/gpu/wheels.sh)"; exit 1; }
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
{ if [ $DRY = 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"

# 2. The measurements: 30 s above check.py's own deadline (Plan.deadline_s: 450 / 300 s): the backstop only.
timeout $([ $DRY = 1 ] && echo 330 || echo 480) "$PY" -m benchmarks.gpu.check --out "$OUT" $DRYFLAG 2>&1 \
    | tee "$OUT/gpu_check.log"
check=${PIPESTATUS[0]}

# 3. The peers in their own process, then merged (a status says why one has no number, if it has none): what is
#    left of TOTAL; under 30 s it is not started (merged as not run).
if [ $DRY = 1 ]; then child_s=90; else child_s=$(( TOTAL - SECONDS - 25 )); fi
if [ $child_s -ge 30 ]; then
    timeout $((child_s + 20)) "$PY" -m benchmarks.gpu.compiled --out "$OUT" --seconds $child_s $DRYFLAG 2>&1 \
        | tee "$OUT/gpu_compiled.log"
    compiled=${PIPESTATUS[0]}
else
    compiled=-1
fi
"$PY" -m benchmarks.gpu.compiled --out "$OUT" --merge=$compiled --seconds $((child_s + 20)) 2>&1 \
    | tee -a "$OUT/gpu_compiled.log"

# 4. The CUDA tests, last and only with time left: they prove the paths on CUDA; the numbers above do not need them.
if [ "${GPU_CHECK_TESTS:-1}" = 0 ]; then  # CI: the suite has just run these tests
    echo "tests/test_capture.py: left out here (GPU_CHECK_TESTS=0)" | tee "$OUT/cuda_tests.log"; tests=0
elif [ $DRY = 0 ] && [ $(( TOTAL - SECONDS )) -lt $TESTS ]; then
    echo "tests/test_capture.py: not run (under $TESTS s of $TOTAL left)" | tee "$OUT/cuda_tests.log"; tests=0
else
    timeout $TESTS "$PY" -m pytest -q -p no:cacheprovider -m "not compile" tests/test_capture.py 2>&1 \
        | tee "$OUT/cuda_tests.log"
    tests=${PIPESTATUS[0]}
fi
echo "measurements exit $check, peers exit $compiled, tests exit $tests; ${SECONDS} s; results in $OUT"
exit $(( check != 0 || compiled > 0 || tests != 0 ))
