# shellcheck shell=bash
# Sourced by scripts/prepare.sh, scripts/test.sh, scripts/setup-and-demo.sh and .ci/run: picks the
# project's Python interpreter (PY) and puts its scripts folder (runbook, ansible, kubectl) first on PATH.
# Order: $RUNBOOK_PYTHON, ./.venv, then a python3 >= 3.11 that pip may install into (not "externally
# managed" as Debian's own is). PY stays empty when none fits: prepare.sh then creates ./.venv.
RB_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rb_python_fits() {  # rb_python_fits PYTHON [allow-managed]
  "$1" - "${2:-}" <<'PYEOF' 2>/dev/null
import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if sys.version_info >= (3, 11) and (not managed or sys.argv[1] == "allow-managed") else 1)
PYEOF
}
rb_pick_python() {
  local candidate path
  if [ -n "${RUNBOOK_PYTHON:-}" ]; then echo "$RUNBOOK_PYTHON"; return; fi
  if [ -x "$RB_ROOT/.venv/bin/python" ]; then echo "$RB_ROOT/.venv/bin/python"; return; fi
  for candidate in python3 python3.13 python3.12 python3.11; do
    path=$(command -v "$candidate") || continue
    if rb_python_fits "$path"; then echo "$path"; return; fi
  done
}
rb_use_python() {
  PY=$1
  PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
  export PY PATH
}
PY=$(rb_pick_python)
if [ -n "$PY" ]; then rb_use_python "$PY"; fi
