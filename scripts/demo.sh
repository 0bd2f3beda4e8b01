#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: a small GPT trained on CPU on the default
# corpus, then a summary table. Extra arguments go to scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" scripts/demo.py "$@"
