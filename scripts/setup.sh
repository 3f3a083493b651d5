#!/usr/bin/env bash
# Create .venv (once) and install nbaccel with its test tools into it. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch is pinned: a loose request would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0" numpy
.venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
# A kernel spec inside the venv, so notebooks run on this interpreter.
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
