#!/usr/bin/env bash
# What scripts/test.sh runs in the background while the main suite runs, so that CI waits for the
# longest of the two and not their sum:
#   1. build the torch-floor and torch_xla venvs (pip; niced), while test.sh sets up .venv;
#   2. once FOLDER/setup.done exists, run the Ray, torch-floor and torch_xla suites (niced), in a
#      network namespace with only loopback and in a temporary folder of their own: no port they bind
#      and nothing they leave in /tmp meets the main suite's checks of ports, folders and processes.
# Usage: bash scripts/tests_beside_main.sh FOLDER
# Each step writes its output to FOLDER/STEP.log and its exit status to FOLDER/STEP.status; the steps
# are build-floor, build-xla, ray, floor and xla. NBACCEL_SKIP_RAY/FLOOR/XLA=1 skip a suite.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: $0 FOLDER}

step() {  # step NAME COMMAND...: run COMMAND, its output and status into FOLDER
  local name=$1
  shift
  "$@" > "$out/$name.log" 2>&1
  echo $? > "$out/$name.status"
}

if [ "${2:-}" = "--suites" ]; then  # the second half, inside the namespace
  TMPDIR=$(mktemp -d /tmp/nbaccel-beside.XXXXXX)
  export TMPDIR
  [ "${NBACCEL_SKIP_RAY:-0}" = "1" ] || step ray nice -n 5 bash scripts/test_ray.sh
  [ "${NBACCEL_SKIP_FLOOR:-0}" = "1" ] || step floor nice -n 5 bash tests/run_torch_floor.sh
  [ "${NBACCEL_SKIP_XLA:-0}" = "1" ] || step xla nice -n 5 bash tests/run_xla.sh
  rm -rf "$TMPDIR"
  exit 0
fi

# The builds need the package index, so they run out here; a suite whose build failed reports it again.
# They need nothing of .venv, so they start while test.sh still sets it up.
[ "${NBACCEL_SKIP_FLOOR:-0}" = "1" ] || NBACCEL_PREPARE_ONLY=1 step build-floor nice -n 10 bash tests/run_torch_floor.sh
[ "${NBACCEL_SKIP_XLA:-0}" = "1" ] || NBACCEL_PREPARE_ONLY=1 step build-xla nice -n 10 bash tests/run_xla.sh
# The suites need .venv: test.sh creates FOLDER/setup.done once it is ready (and stops this script if setup fails).
while [ ! -e "$out/setup.done" ]; do sleep 1; done
exec "${PYTHON:-.venv/bin/python}" scripts/loopback_namespace.py bash scripts/tests_beside_main.sh "$out" --suites
