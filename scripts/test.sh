#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
# PYTHON=python3.12 scripts/test.sh: the same on Python 3.12 and megatron-core 0.19 (.venv-3.12),
# Megatron-LM's training loop included.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
# From Python 3.12 (megatron-core 0.19) Megatron-LM's training loop ships with megatron-core:
# its other imports too, so that tests/megatron_lm runs it.
if "$python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  export EXTRAS=${EXTRAS:+$EXTRAS,}megatron-lm
fi
scripts/setup.sh
exec "$VENV/bin/python" -m pytest -q tests "$@"
