#!/bin/bash
# The whole test suite (unit and integration; `slow` fault-injection cases excluded), exactly as CI
# runs it: the README's second command, and what .ci/run calls. Extra arguments go to pytest.
# Needs what scripts/prepare.sh installs. Under CI=true a missing prerequisite fails instead of skipping.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
[ -n "$PY" ] || { echo "test.sh: no Python >= 3.11 with the project installed: run scripts/prepare.sh" >&2; exit 2; }
"$PY" -m pytest -p no:cacheprovider -v --durations=30 -m "not slow" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
