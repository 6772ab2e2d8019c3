#!/bin/bash
# The whole test suite (unit and integration; `slow` fault-injection cases excluded), exactly as CI
# runs it: the README's second command, and what .ci/run calls. Extra arguments go to pytest.
# Needs what scripts/prepare.sh installs. Under CI=true a missing prerequisite fails instead of skipping.
#
# Two phases: the unit tests (tests/unit, no lab) over both cores with pytest-xdist (`-n 2`), then
# everything else (the integration and lab tests, which share one control plane and one lab per
# module) serially in one process. Each phase reports its 30 slowest tests. With arguments, one
# serial pytest run over exactly what they name (e.g. `scripts/test.sh tests/unit/test_loader.py -x`).
# Exit code: pytest's; a phase that collects nothing (pytest's 5) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
[ -n "$PY" ] || { echo "test.sh: no Python >= 3.11 with the project installed: run scripts/prepare.sh" >&2; exit 2; }
PYTEST=("$PY" -m pytest -p no:cacheprovider -v --durations=30 -m "not slow")

phase() {  # phase NAME PYTEST-ARGS...: runs pytest, maps "collected nothing" (5) to a failure
  local name=$1 rc; shift
  "${PYTEST[@]}" "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests ($name): failing" >&2; rc=1; fi
  return "$rc"
}

if [ "$#" -gt 0 ]; then
  phase "arguments" "$@"
  exit $?
fi
phase "unit tests, 2 workers" -n 2 tests/unit
unit=$?
phase "integration and lab tests, serial" tests --ignore=tests/unit
rest=$?
[ "$unit" -eq 0 ] || { echo "test.sh: unit tests failed (rc=$unit)" >&2; exit "$unit"; }
exit "$rest"
