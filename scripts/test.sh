#!/usr/bin/env bash
# Set up from nothing and run the whole test suite: the main suite (browser tests included) and, beside it, the Ray,
# torch-floor and torch_xla suites.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Ray, torch-floor and torch_xla suites (and the pip installs of the latter two's venvs) run in the
# background beside the main suite, niced, in a loopback-only network namespace and a temporary folder of their
# own (scripts/tests_beside_main.sh); their output is shown after the main suite's. It starts with the
# venv builds, which need nothing of .venv, and waits for setup.done before the suites.
beside=$(mktemp -d)
setsid bash scripts/tests_beside_main.sh "$beside" > "$beside/beside.log" 2>&1 &
beside_pid=$!  # its own process group (setsid): an early exit stops it all
# `|| true`: under set -e a failed kill (the group already gone, as after a normal run) would turn the exit status to 1
trap 'kill -- -"$beside_pid" 2>/dev/null || true; rm -rf "$beside"' EXIT
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
touch "$beside/setup.done"
export OMP_NUM_THREADS=1
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" || status=$?
wait "$beside_pid" || true
for step in build-floor build-xla ray floor xla; do
  [ -f "$beside/$step.status" ] || continue
  step_status=$(cat "$beside/$step.status")
  case "$step" in
    build-*) [ "$step_status" = 0 ] && continue ;;  # a build's output is shown only when it failed
  esac
  echo "===== $step (run beside the main suite): exit status $step_status ====="
  cat "$beside/$step.log"
  [ "$step_status" = 0 ] || status=$step_status
done
if [ -s "$beside/beside.log" ]; then
  cat "$beside/beside.log" >&2
fi
exit $status
