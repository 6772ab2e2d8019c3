#!/usr/bin/env bash
# The omen2 recovery with no checks at all: the three steps of gpu-node-recovery, in order, with
# the project's own playbooks. Baseline (b) of benchmark P1: what doing it blind costs.
#
#   bench/baseline/recover-bare.sh [NODE]     # default omen2
#
# Needs KUBECONFIG and RUNBOOK_INVENTORY (eval "$(runbook lab env)"). It ends when the kubelet
# restart returns: it neither waits for the node to turn Ready nor looks at anything.
set -euo pipefail

NODE=${1:-omen2}
INV=${RUNBOOK_INVENTORY:?set RUNBOOK_INVENTORY (eval "\$(runbook lab env)")}
PLAYBOOKS=${RUNBOOK_PLAYBOOKS_DIR:-$(cd "$(dirname "$0")/../../playbooks" && pwd)}

kubectl label node "$NODE" nvidia.com/gpu.workload.config=container --overwrite
ansible-playbook -i "$INV" "$PLAYBOOKS/swap-off.yml" --limit "$NODE" -e "target=$NODE"
ansible-playbook -i "$INV" "$PLAYBOOKS/restart-kubelet.yml" --limit "$NODE" -e "target=$NODE"
