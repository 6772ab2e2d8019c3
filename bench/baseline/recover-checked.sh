#!/usr/bin/env bash
# The omen2 recovery as a careful operator scripts it: the same steps as the runbook
# gpu-node-recovery, in the same order, with the project's own playbooks, and the same checks,
# done with standard tools (kubectl and the Ansible CLI). Baseline (a) of benchmark P1.
#
#   bench/baseline/recover-checked.sh [NODE]     # default omen2
#
# Needs KUBECONFIG and RUNBOOK_INVENTORY (eval "$(runbook lab env)"); the inventory host has the
# node's name and carries its become password (as the lab's does). Waits as long as the runbook:
# Ready within 120 s, nvidia.com/gpu within 180 s.
#
# The checks are those of issue 9's list: the label (kubectl), swap, fstab and kubelet
# (`ansible -m command`), Ready (`kubectl wait`), allocatable and label (`kubectl get`). The runbook
# checks more (preconditions, the guards re-read before the restart, the GPU driver, the CUDA
# jobs alive): this script is the lighter of the two.
set -euo pipefail

NODE=${1:-omen2}
HOST=$NODE
INV=${RUNBOOK_INVENTORY:?set RUNBOOK_INVENTORY (eval "\$(runbook lab env)")}
PLAYBOOKS=${RUNBOOK_PLAYBOOKS_DIR:-$(cd "$(dirname "$0")/../../playbooks" && pwd)}
LABEL=nvidia.com/gpu.workload.config
LABEL_PATH='{.metadata.labels.nvidia\.com/gpu\.workload\.config}'
GPU_PATH='{.status.allocatable.nvidia\.com/gpu}'

die() { echo "recover-checked: $*" >&2; exit 1; }
step() { echo "== $*"; }
# ad-hoc command on the node host as root; prints the command's stdout (ansible's header line dropped)
on_host() { ansible "$HOST" -i "$INV" -b -m command -a "$1" | sed 1d; }

# 1. The GPU workload label must read `container` before kubelet comes back.
step "relabel $NODE to container"
kubectl label node "$NODE" "$LABEL=container" --overwrite
[ "$(kubectl get node "$NODE" -o jsonpath="$LABEL_PATH")" = container ] || die "label not set"

# 2. Swap off now and in /etc/fstab, then check both.
step "swap off"
ansible-playbook -i "$INV" "$PLAYBOOKS/swap-off.yml" --limit "$HOST" -e "target=$HOST"
[ -z "$(on_host 'swapon --show --noheadings')" ] || die "swap is still on"
[ -z "$(on_host "awk '\$1 !~ /^#/ && \$3 == \"swap\"' /etc/fstab")" ] || die "fstab still has an active swap entry"

# 3. Restart kubelet.
step "restart kubelet"
ansible-playbook -i "$INV" "$PLAYBOOKS/restart-kubelet.yml" --limit "$HOST" -e "target=$HOST"

# 4. The node is Ready, kubelet is active, the GPU is served to pods, still under the container
#    workload. (kubelet is checked once the node is Ready: right after a restart it reads
#    `activating` for a moment, and a retry loop would only add sleeps to this script.)
step "verify $NODE"
kubectl wait --for=condition=Ready "node/$NODE" --timeout=120s
state=$(on_host 'systemctl is-active kubelet' 2>/dev/null || true)
[ "$state" = active ] || die "kubelet is ${state:-unknown}, not active"
for _ in $(seq 180); do
  gpus=$(kubectl get node "$NODE" -o jsonpath="$GPU_PATH")
  [ "${gpus:-0}" -ge 1 ] && break
  sleep 1
done
[ "${gpus:-0}" -ge 1 ] || die "nvidia.com/gpu not allocatable"
[ "$(kubectl get node "$NODE" -o jsonpath="$LABEL_PATH")" = container ] || die "label changed"
echo "recovered: $NODE Ready, nvidia.com/gpu=$gpus, $LABEL=container"
