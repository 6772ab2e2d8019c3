#!/usr/bin/env bash
# A fleet of GPU nodes down for swap, recovered the way a careful operator scripts it by hand:
# the three steps of gpu-node-recovery with the project's own playbooks, ONE ansible-playbook
# process over every host of the fleet (both playbooks in it, in order), kubectl for the rest, and
# the waits the runbook's verification does (Ready, nvidia.com/gpu advertised). Baseline of
# benchmark P7 (bench/p7_fleet.py).
#
#   bench/baseline/recover-fleet.sh SELECTOR [FORKS]     # e.g. bench.runbook.io/fleet20=true 10
#
# Needs KUBECONFIG and RUNBOOK_INVENTORY (eval "$(runbook lab env)"); inventory hosts have the
# nodes' names and carry their become passwords (as the lab's do). Lighter than the runbook: no
# preconditions, no guards, no per-node check of swap, fstab, the driver or the CUDA jobs, and
# one host failing stops nothing for the others.
set -euo pipefail

SELECTOR=${1:?usage: recover-fleet.sh SELECTOR [FORKS]}
FORKS=${2:-10}
INV=${RUNBOOK_INVENTORY:?set RUNBOOK_INVENTORY (eval "\$(runbook lab env)")}
PLAYBOOKS=${RUNBOOK_PLAYBOOKS_DIR:-$(cd "$(dirname "$0")/../../playbooks" && pwd)}
LABEL=nvidia.com/gpu.workload.config

hosts=$(kubectl get nodes -l "$SELECTOR" -o jsonpath='{range .items[*]}{.metadata.name}{","}{end}')
hosts=${hosts%,}
[ -n "$hosts" ] || { echo "recover-fleet: no node matches $SELECTOR" >&2; exit 1; }

# 1. The GPU workload label must read `container` before kubelet comes back.
kubectl label nodes -l "$SELECTOR" "$LABEL=container" --overwrite
# 2 + 3. Swap off, then restart kubelet: one ansible-playbook over every host.
ansible-playbook -i "$INV" -f "$FORKS" --limit "$hosts" "$PLAYBOOKS/swap-off.yml" "$PLAYBOOKS/restart-kubelet.yml"
# The nodes are Ready and serve their GPU to pods.
kubectl wait --for=condition=Ready nodes -l "$SELECTOR" --timeout=120s
kubectl wait --for=jsonpath='{.status.allocatable.nvidia\.com/gpu}'=1 nodes -l "$SELECTOR" --timeout=180s
echo "recovered: $(echo "$hosts" | tr ',' '\n' | wc -l) nodes matching $SELECTOR"
