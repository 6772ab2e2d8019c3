#!/bin/bash
# Install everything the project, its lab and its tests need on a Debian/Ubuntu machine, as root:
# apt packages (only when one is missing), the project with its dev and kubectl extras (pip; a
# ./.venv when the system Python is "externally managed"), kubectl, and the control-plane binaries
# (built once, ~6 min, cached in ~/.cache/runbook). Safe to run again: it reuses what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[prepare] %s\n' "$*"; }
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

[ "$(uname -s)" = Linux ] || { say "needs Linux"; exit 2; }
[ "$(id -u)" = 0 ] || { say "needs root (apt, mount namespaces for the node hosts)"; exit 2; }
command -v apt-get >/dev/null || { say "needs apt (Debian or Ubuntu)"; exit 2; }

PACKAGES="openssh-server openssh-client sudo rsync curl openssl ca-certificates prometheus-alertmanager
  prometheus python3 make util-linux debian-archive-keyring wrk tmux chromium chromium-driver"
. scripts/env.sh
[ -n "$PY" ] || PACKAGES="$PACKAGES python3-venv python3-pip"
missing=$(for p in $PACKAGES; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"; done)
if [ -n "$missing" ]; then
  say "apt: installing $(echo $missing)"
  export DEBIAN_FRONTEND=noninteractive
  # Why: prometheus, prometheus-alertmanager and openssh-server ship system services that would
  # listen beyond loopback; the lab and the tests start their own. Forbid starting any unit while
  # installing (invoke-rc.d honours policy-rc.d), unless the machine already has its own policy.
  own_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# runbook prepare.sh: no service starts during this install\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt-get update -q
  apt-get install -y -q --no-install-recommends $missing
  if [ -n "$own_policy" ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
else
  say "apt: all packages present"
fi

if [ -z "$PY" ]; then
  for candidate in python3 python3.13 python3.12 python3.11; do
    path=$(command -v "$candidate") || continue
    if rb_python_fits "$path" allow-managed; then base=$path; break; fi
  done
  [ -n "${base:-}" ] || { say "needs Python >= 3.11 (apt-get install python3.11 or newer)"; exit 2; }
  say "creating .venv with $base (the system Python is externally managed)"
  "$base" -m venv .venv
  PY=.venv/bin/python
fi
rb_use_python "$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
say "python: $PY ($("$PY" --version))"

say "pip: installing the project with its dev and kubectl extras"
"$PY" -m pip install -q --disable-pip-version-check -e '.[dev,kubectl]'
# An editable install leaves the engine's bytecode to the first import, which PYTHONDONTWRITEBYTECODE
# (set on some machines, CI's among them) forbids: every command would compile ~150 modules again
# (~0.2 s each time). Compiled once here, as pip does for a wheel; a changed file is recompiled.
"$PY" -m compileall -q engine >/dev/null

if command -v kubectl >/dev/null; then
  say "kubectl: $(command -v kubectl)"
else
  say "kubectl: not found after pip; installing Debian's kubernetes-client"
  apt-get install -y -q --no-install-recommends kubernetes-client
fi

bash scripts/build-control-plane.sh
