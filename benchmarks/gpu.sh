#!/usr/bin/env bash
# The GPU check of the CuPy kernels, in one go (about 5 minutes at most), on a machine with an NVIDIA
# GPU and CuPy and PyTorch already installed; no network, nothing gets installed.
#   1. the kernel tests (tests/test_cupy_kernels.py: real kernels against the array-API path, torch
#      interop; tests/test_cuda_sources.py: nvcc compile checks), with PORTABLE_SSM_CUPY_KERNELS=1;
#   2. the timing table (benchmarks/gpu_bench.py), appended to benchmarks/RESULTS.md with the date,
#      the card's name and the tests' outcome.
# The benchmark runs even when a test fails (its record says so); the script then exits non-zero.
# Usage: benchmarks/gpu.sh            (PYTHON=/path/to/python chooses the interpreter)
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
export PORTABLE_SSM_CUPY_KERNELS=1

# portable_ssm.backends is the backends/ folder (pyproject's package-dir): use an installed copy if
# there is one, else a temporary overlay of symlinks that lays the checkout out as installed.
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK" || exit 1
if ! "$PY" -c "import portable_ssm.backends" 2>/dev/null; then
    mkdir "$WORK/portable_ssm"
    ln -s "$REPO"/portable_ssm/*.py "$WORK/portable_ssm/"
    ln -s "$REPO/backends" "$WORK/portable_ssm/backends"
    export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import cupy, portable_ssm.backends.cupy"; then
    echo "gpu.sh: needs CuPy (and an NVIDIA GPU) for $PY; nothing run" >&2
    exit 2
fi

timeout 150 "$PY" -m pytest "$REPO/tests/test_cupy_kernels.py" "$REPO/tests/test_cuda_sources.py" \
    -q -rs -p no:cacheprovider
case $? in
    0) tests="passed" ;;
    124) tests="timed out after 150 s" ;;
    *) tests="FAILED (see the pytest output)" ;;
esac

timeout 210 "$PY" "$REPO/benchmarks/gpu_bench.py" --out "$REPO/benchmarks/RESULTS.md" --budget-s 170 \
    --tests "$tests"
bench=$?

[ "$tests" = "passed" ] && [ $bench -eq 0 ]
