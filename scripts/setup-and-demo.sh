#!/bin/bash
# The README's first command: install everything (scripts/prepare.sh: apt packages, the project with
# pip, kubectl, the cached control-plane build), then run the main job on the lab. Until the lab CLI
# exists (`runbook lab --help` fails), bring the test bed up and show it working instead.
# Needs root on a Debian/Ubuntu machine; the first run takes about 6-8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/prepare.sh
. scripts/env.sh

if runbook lab --help >/dev/null 2>&1; then
  runbook lab down >/dev/null 2>&1 || true   # a lab left by an earlier run: start afresh
  echo "=== runbook lab up"
  runbook lab up
  eval "$(runbook lab env)"                  # KUBECONFIG and inventory of the lab
  echo "=== runbook run gpu-node-recovery --node omen2 --yes"
  runbook run gpu-node-recovery --node omen2 --yes
  echo "=== done: the lab is still up (runbook lab status; runbook lab down stops it)"
else
  echo "=== the lab CLI is not there yet: showing the test bed (python -m engine.lab.testbed_demo)"
  "$PY" -m engine.lab.testbed_demo
fi
