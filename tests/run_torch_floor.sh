#!/usr/bin/env bash
# The oldest torch pyproject.toml allows (its `torch>=X.Y` floor): build .venv-torch-floor once with
# that torch (PyPI's CUDA build, which imports and runs gloo on a CPU-only machine; about 4 GB, 2-3
# minutes), reuse it while its stamp matches, then run the tests that use torch's newest APIs: every
# torch import of the package (tests/test_torch_floor.py), FSDP2 preparing, saving and loading,
# checkpoints, the process group on GPUs (faked). Under torch 2.6 FSDP2 cannot train on CPU (torch's
# own limit), so those tests skip there and the import check is what covers FSDP2. Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FLOOR=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$FLOOR" ] || { echo "run_torch_floor.sh: no \"torch>=X.Y\" line in pyproject.toml" >&2; exit 2; }
case "$FLOOR" in *.*.*) ;; *) FLOOR="$FLOOR.0" ;; esac
VENV=${NBACCEL_FLOOR_VENV:-.venv-torch-floor}
DEPS="numpy ipython ipykernel ipywidgets cloudpickle safetensors pyyaml packaging pytest pytest-timeout"
STAMP="$VENV/.nbaccel-floor-stamp"
WANT="torch==$FLOOR $DEPS | $("$PY" --version 2>&1) | $(pwd)"

quiet_pip() {  # pip's notes about find-links folders that are not on this machine are noise
  "$VENV/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  if ! "$VENV/bin/python" -c "" 2>/dev/null; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
  fi
  echo "run_torch_floor.sh: preparing $VENV (torch==$FLOOR)" >&2
  quiet_pip install -q --disable-pip-version-check "torch==$FLOOR" $DEPS
  quiet_pip install -q --disable-pip-version-check --no-deps -e .
  echo "$WANT" > "$STAMP"
fi
# NBACCEL_PREPARE_ONLY=1: build the venv and stop (scripts/tests_beside_main.sh builds it during setup).
[ "${NBACCEL_PREPARE_ONLY:-0}" != "1" ] || exit 0

export OMP_NUM_THREADS=1 NBACCEL_TORCH_FLOOR=$FLOOR
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_torch_floor.py tests/training/test_fsdp.py tests/training/test_fsdp_materialize.py \
  tests/training/test_fsdp_checkpoints.py tests/training/test_cuda_collectives.py \
  tests/training/test_checkpointing.py "$@"
