#!/usr/bin/env bash
# Create .venv (if missing) and install ffdebug with the trainer and test extras, at the exact versions
# of constraints/ci.txt (pyproject.toml declares ranges; docs/install.md "Install and compatibility").
# torch==2.13.0 resolves to the CPU wheel on our machines; unpinned torch may pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,trainer]" -c constraints/ci.txt 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import ffdebug, torch, transformers, diffusers; print('ffdebug', ffdebug.__version__, 'torch', torch.__version__)"
