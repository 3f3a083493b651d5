#!/usr/bin/env bash
# Set up from nothing and run the whole test suite (main suite, browser test, torch_xla suite).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The peer, for tests/training/test_accelerate_parity.py and tests/accelerate_compat/ (the same code
# through Accelerate and nbaccel gives the same results), `datasets` for the Dataset cases there, and
# `transformers` for the device-map zoo (models built from configs, nothing downloaded), `evaluate` because
# Accelerate's test_metrics script imports it (tests/accelerate_compat/test_accelerate_scripts.py);
# nbaccel itself never imports any of them.
.venv/bin/pip install -q --disable-pip-version-check accelerate datasets transformers evaluate 2> >(grep -v "is ignored: it is neither" >&2)
if [ -f .ci/browser_setup.sh ]; then
  bash .ci/browser_setup.sh .venv
fi
export OMP_NUM_THREADS=1
# The torch-floor and torch_xla venvs (about 5 minutes of pip) are built in the background, one after the other and
# niced, while the main suite runs; their suites below wait for that. Should it fail, each script builds its venv
# again itself and shows why.
prepare_log=$(mktemp)
prepare='
if [ -f tests/run_torch_floor.sh ] && [ "${NBACCEL_SKIP_FLOOR:-0}" != "1" ]; then nice -n 10 bash tests/run_torch_floor.sh || exit 1; fi
if [ -f tests/run_xla.sh ] && [ "${NBACCEL_SKIP_XLA:-0}" != "1" ]; then nice -n 10 bash tests/run_xla.sh || exit 1; fi'
NBACCEL_PREPARE_ONLY=1 setsid bash -c "$prepare" > "$prepare_log" 2>&1 &
prepare_pid=$!  # its own process group (setsid): an early exit kills pip with it
# `|| true`: under set -e a failed kill (the group already gone, as after a normal run) would turn the exit status to 1
trap 'kill -- -"$prepare_pid" 2>/dev/null || true; rm -f "$prepare_log"' EXIT
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" || status=$?
# Ray listens on every interface: its tests (and notebook 07) run in a loopback-only network namespace.
if [ "${NBACCEL_SKIP_RAY:-0}" != "1" ]; then
  bash scripts/test_ray.sh || status=$?
fi
if ! wait "$prepare_pid"; then
  echo "test.sh: building the floor/XLA venvs in the background failed (its log below); the suites build them again." >&2
  tail -20 "$prepare_log" >&2
fi
rm -f "$prepare_log"
# The oldest torch pyproject.toml allows (its own venv, built once).
if [ -f tests/run_torch_floor.sh ] && [ "${NBACCEL_SKIP_FLOOR:-0}" != "1" ]; then
  bash tests/run_torch_floor.sh || status=$?
fi
if [ -f tests/run_xla.sh ] && [ "${NBACCEL_SKIP_XLA:-0}" != "1" ]; then
  bash tests/run_xla.sh || status=$?
fi
exit $status
