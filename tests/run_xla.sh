#!/usr/bin/env bash
# The torch_xla suite: build .venv-xla once (torch 2.9.0 + torch_xla 2.9.0, about 7 GB and under
# 2 minutes), reuse it while its stamp matches, then run the tests marked `xla` on torch_xla's CPU
# runtime (PJRT_DEVICE=CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# NBACCEL_XLA_VERSION=2.8.0 tests the pair Kaggle's TPU image pins (in .venv-xla-2.8.0).
XLA_VERSION=${NBACCEL_XLA_VERSION:-2.9.0}
DEFAULT_VENV=.venv-xla
[ "$XLA_VERSION" = 2.9.0 ] || DEFAULT_VENV=.venv-xla-$XLA_VERSION
VENV=${NBACCEL_XLA_VENV:-$DEFAULT_VENV}
# torch_xla declares no torch requirement but only works with the torch of its own version: pin both.
PINS="torch==$XLA_VERSION torch_xla==$XLA_VERSION"
DEPS="numpy ipython ipykernel ipywidgets cloudpickle safetensors pyyaml nbclient nbformat pytest pytest-timeout"
STAMP="$VENV/.nbaccel-xla-stamp"
WANT="$PINS $DEPS | $("$PY" --version 2>&1) | $(pwd)"

quiet_pip() {  # pip's notes about find-links folders that are not on this machine are noise
  "$VENV/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  if ! "$VENV/bin/python" -c "" 2>/dev/null; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
  fi
  echo "run_xla.sh: preparing $VENV ($PINS)" >&2
  quiet_pip install -q --disable-pip-version-check $PINS $DEPS
  quiet_pip install -q --disable-pip-version-check --no-deps -e .
  "$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
  echo "$WANT" > "$STAMP"
fi
# NBACCEL_PREPARE_ONLY=1: build the venv and stop (scripts/tests_beside_main.sh builds it during setup).
[ "${NBACCEL_PREPARE_ONLY:-0}" != "1" ] || exit 0

export PJRT_DEVICE=CPU OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2
unset CPU_NUM_DEVICES NBACCEL_TPU
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m xla tests/xla "$@"
