#!/usr/bin/env bash
# The main job: set up, then run notebooks/01_quickstart.ipynb headless in a real Jupyter kernel
# (2 CPU workers) and print what its cells printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python scripts/run_notebook.py notebooks/01_quickstart.ipynb "$@"
