#!/usr/bin/env bash
# Fetch (here, where PyPI is reachable) the wheels benchmarks/gpu/check.sh installs on the GPU machine,
# which has transformers 5.17 and can fetch nothing: the pinned transformers (pure Python) and a regex
# new enough for it, for that machine's Python 3.12 / x86-64. They go to .whl/, which git ignores.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "transformers==5.23.0"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "regex==2026.11.19"
ls -l .whl
