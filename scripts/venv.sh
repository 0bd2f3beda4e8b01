# Sourced by the scripts that set up or use the virtual environment: which Python ($PYTHON,
# python3 by default) and which environment (.venv for the default Python, .venv-X.Y for
# another, e.g. PYTHON=python3.12 makes .venv-3.12 with megatron-core 0.19; $VENV overrides).
python=${PYTHON:-python3}
if [ -z "${VENV:-}" ]; then
  if [ -n "${PYTHON:-}" ]; then
    VENV=.venv-$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  else
    VENV=.venv
  fi
fi
