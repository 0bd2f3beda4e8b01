#!/usr/bin/env bash
# Check every GPU path on this machine (1 to 8 GPUs), or the same stages small on CPU over
# gloo where there is no CUDA: one PASS/FAIL table, also written as gpu_check.md and
# gpu_check.json under --out (default runs/gpu_check). Arguments go to scripts/gpu_check.py.
#
# It uses the torch already installed ($PYTHON, default python3): a GPU machine has its own
# CUDA build, so nothing here installs torch. megatron-core 0.16.1, psutil and einops are installed
# if missing, without their dependencies; on a machine without a package index, point
# WHEELS at a folder holding their wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
for requirement in megatron-core==0.16.1 psutil einops; do
  module=${requirement%%==*}; module=${module/megatron-core/megatron.core}
  if ! "$python" -c "import $module" 2>/dev/null; then
    "$python" -m pip install --quiet --disable-pip-version-check --no-deps ${WHEELS:+--no-index --find-links "$WHEELS"} "$requirement"
  fi
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$python" scripts/gpu_check.py "$@"
