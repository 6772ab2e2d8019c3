#!/bin/bash
# The whole test suite (unit and integration; `slow` fault-injection cases excluded), exactly as CI
# runs it: the README's second command, and what .ci/run calls. Extra arguments go to pytest.
# Needs what scripts/prepare.sh installs. Under CI=true a missing prerequisite fails instead of skipping.
#
# Two phases, each over both cores with pytest-xdist: the unit tests (tests/unit, no lab; `-n 2`, test
# by test), then everything else (the integration and lab tests) with `--dist loadfile`: a whole test
# module runs on one worker, in file order, so a module's shared lab and module-scoped fixtures stay
# its own. Each worker has its own session lab and test-bed control plane (own temp folders, ports
# and loopback addresses chosen at run time: engine/lab/ports.py). `--no-loadscope-reorder` keeps
# collection order (tests/integration/lab/ first, its longest module, test_bench_quick, at the head):
# xdist would otherwise start the modules with most tests first and leave the long one-test modules
# for the end. docs/reliability.md ("CI time budget") says what each phase costs. Each phase reports
# its 30 slowest tests. With arguments, one serial pytest run over exactly what they name (e.g.
# `scripts/test.sh tests/unit/test_loader.py -x`).
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
workers=${RUNBOOK_TEST_WORKERS:-2}  # the integration phase's workers (CI: 2, one per core; a measurement may try others)
phase "integration and lab tests, $workers workers, one module per worker" -n "$workers" --dist loadfile \
  --no-loadscope-reorder tests --ignore=tests/unit
rest=$?
[ "$unit" -eq 0 ] || { echo "test.sh: unit tests failed (rc=$unit)" >&2; exit "$unit"; }
exit "$rest"
