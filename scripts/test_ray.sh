#!/usr/bin/env bash
# Run the Ray tests (tests/ray, notebook 07 included) inside a network namespace of their own with
# only loopback up: Ray listens on every interface and talks to this machine's own address
# otherwise. Needs root. Usage: bash scripts/test_ray.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS=1
exec "$PY" scripts/loopback_namespace.py "$PY" -m pytest -q -p no:cacheprovider tests/ray "$@"
