#!/usr/bin/env bash
# Create the virtual environment (.venv; with PYTHON=python3.12, .venv-3.12: scripts/venv.sh)
# and install higgs-megatron with its test extra. The Python picks the megatron-core release
# (pyproject.toml): 0.16.1 on Python 3.11, 0.19 on 3.12.
# torch is installed first, pinned, so that pip does not resolve a bare "torch" to a
# multi-GB CUDA build on a CPU machine where a CPU wheel is at hand. Override with TORCH_SPEC
# (e.g. "torch==2.13.0" plus PIP_INDEX_URL=https://download.pytorch.org/whl/cpu where no local
# CPU wheel exists). On Python 3.12 the registry's torch 2.13.0 is its CUDA build: it runs on
# the CPU too.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
if [ ! -x "$VENV/bin/python" ]; then
  "$python" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test${EXTRAS:+,$EXTRAS}]"
"$VENV/bin/python" -W ignore -c "import higgs_megatron, torch; from higgs_megatron.compat.versions import MEGATRON_CORE_VERSION as core; print(f'higgs-megatron {higgs_megatron.__version__}, megatron-core {core}, torch {torch.__version__}')"
