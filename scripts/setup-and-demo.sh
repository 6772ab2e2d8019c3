#!/bin/bash
# The README's first command: install everything (scripts/prepare.sh: apt packages, the project with
# pip, kubectl, the cached control-plane build), then run the main job on the lab: the omen2 incident
# reproduced, and recovered by `runbook run gpu-node-recovery --node omen2 --yes`.
# Needs root on a Debian/Ubuntu machine; the first run takes about 6-8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/prepare.sh
. scripts/env.sh

runbook lab down >/dev/null 2>&1 || true   # a lab left by an earlier run: start afresh
echo "=== runbook lab up"
runbook lab up
eval "$(runbook lab env)"                  # KUBECONFIG and inventory of the lab
echo "=== runbook run gpu-node-recovery --node omen2 --yes"
runbook run gpu-node-recovery --node omen2 --yes
echo "=== done: the lab is still up (runbook lab status; runbook lab down stops it)"
