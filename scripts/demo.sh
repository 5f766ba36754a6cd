#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
exec .venv/bin/ffdebug demo "$@"
