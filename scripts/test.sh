#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
# PYTHON=python3.12 scripts/test.sh: the same on Python 3.12 and megatron-core 0.19 (.venv-3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
scripts/setup.sh
exec "$VENV/bin/python" -m pytest -q tests "$@"
