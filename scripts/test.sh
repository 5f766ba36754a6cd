#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run ruff and the whole test suite, as CI does (docs/install.md "Tests"):
#   1. the whole suite on pytest-xdist at twice as many workers as cores (it doubles as the load test:
#      no test may fail because the machine is busy);
#   2. the numeric subset (`-m numeric`: goldens, transcriptions, resume, patterns, noise) again at
#      ATEN_CPU_CAPABILITY=default, torch's scalar kernels, as another CPU would run them; numpy's
#      side likewise: OPENBLAS_CORETYPE=Prescott (OpenBLAS's SSE3 kernels) and numpy without its
#      AVX2 / AVX-512 loops (NPY_DISABLE_CPU_FEATURES).
# Arguments go to pytest and run step 1 only (e.g. `bash scripts/test.sh tests/test_metrics.py`).
# FFDEBUG_TEST_WORKERS=N sets the worker count; FFDEBUG_TEST_TIMEOUT_SCALE=F stretches every hang deadline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error OMP_NUM_THREADS=1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc counts OMP_NUM_THREADS otherwise
workers=${FFDEBUG_TEST_WORKERS:-$((2 * cores))}
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers")
check() {  # pytest's exit code; collecting no test is a failure too
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure" >&2
    return 1
  fi
  return "$rc"
}
start=$(date +%s)
check "${pytest[@]}" --durations=15 "$@"
echo "test suite: passed in $(($(date +%s) - start)) s on $workers workers"
if [ "$#" -eq 0 ]; then
  start=$(date +%s)
  ATEN_CPU_CAPABILITY=default OPENBLAS_CORETYPE=Prescott NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4" \
    check "${pytest[@]}" -m numeric
  echo "numeric subset at ATEN_CPU_CAPABILITY=default, OpenBLAS Prescott, numpy X86_V2: passed in $(($(date +%s) - start)) s"
fi
