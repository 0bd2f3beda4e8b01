#!/usr/bin/env bash
# Create .venv in the repository and install higgs-megatron with its test extra.
# torch is installed first, pinned, so that pip does not resolve a bare "torch" to a
# multi-GB CUDA build on a CPU machine. Override with TORCH_SPEC (e.g. "torch==2.13.0"
# plus PIP_INDEX_URL=https://download.pytorch.org/whl/cpu where no local CPU wheel exists).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test${EXTRAS:+,$EXTRAS}]"
.venv/bin/python -W ignore -c "import higgs_megatron, megatron.core, torch; print(f'higgs-megatron {higgs_megatron.__version__}, megatron-core {megatron.core.__version__}, torch {torch.__version__}')"
