#!/usr/bin/env bash
# Stops the cluster e2e/nodes/up.sh started in DIR and leaves the host as it found it: the
# kubelets, kube-proxy and kube-router first (so nothing restarts a container), then every node's containers
# through its containerd, the pods' network namespaces, the control plane and the containerds
# (e2e/control-plane/down.sh), what is left in the nodes' cgroups, what is still mounted under
# DIR, the cgroups themselves, and last the sysctls, rule sets, ipsets, bridge and fixed paths
# (e2e/nodes/host.sh restore), then checks that the host matches the snapshot taken before the
# start (exit 1 naming each difference). Also stops what a cluster whose processes died left.
# Idempotent; logs stay in DIR.
set -uo pipefail
export PATH=$PATH:/usr/sbin:/sbin

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
[[ -d $1 ]] || exit 0
DIR=$(cd "$1" && pwd)
T0=$SECONDS
log() { echo "[nodes/down.sh $(date +%H:%M:%S) +$((SECONDS - T0))s] $*" >&2; }

# The kubelets, kube-proxy and kube-router of this DIR.
AGENTS="(kubelet|kube-proxy) --config=$DIR/|kube-router --kubeconfig=$DIR/"
for pid in $(pgrep -f -- "$AGENTS" || true); do kill -TERM "$pid" 2>/dev/null; done
for _ in $(seq 50); do pgrep -f -- "$AGENTS" >/dev/null || break; sleep 0.2; done
for pid in $(pgrep -f -- "$AGENTS" || true); do kill -KILL "$pid" 2>/dev/null; done

# Every container and sandbox, through each node's containerd.
for sock in "$DIR"/nodes/*/containerd.sock; do
    [[ -S $sock ]] || continue
    ctr=(ctr -a "$sock" -n k8s.io)
    tasks=$("${ctr[@]}" tasks ls -q 2>/dev/null || true)
    for id in $tasks; do "${ctr[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1; done
    for _ in $(seq 50); do
        "${ctr[@]}" tasks ls 2>/dev/null | awk 'NR > 1 && $3 != "STOPPED" {found = 1} END {exit !found}' || break
        sleep 0.1
    done
    for id in $tasks; do "${ctr[@]}" tasks delete "$id" >/dev/null 2>&1; done
    for id in $("${ctr[@]}" containers ls -q 2>/dev/null || true); do "${ctr[@]}" containers rm "$id" >/dev/null 2>&1; done
done
# The pods' network namespaces (their veths go with them).
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^cni-' || true); do ip netns delete "$ns" 2>/dev/null; done

log "control plane and containerd"
"$ROOT/e2e/control-plane/down.sh" "$DIR" || true
# A shim outlives its containerd when a task could not be deleted.
pkill -KILL -f -- "containerd-shim-runc-v2 .*-address $DIR/nodes/" 2>/dev/null || true

# The containers' processes that no containerd could stop (it died with its shims): whatever
# is still in the nodes' cgroups, unless another cluster's kubelet runs (the names are shared).
if ! pgrep -f "kubelet --config=.*/nodes/.*/kubelet.yaml" >/dev/null; then
    for _ in 1 2 3; do
        pids=$(find /sys/fs/cgroup/tensorfleet-* /sys/fs/cgroup/*/tensorfleet-* -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u)
        [[ -n $pids ]] || break
        log "killing what is left in the nodes' cgroups: $(echo $pids)"
        kill -KILL $pids 2>/dev/null
        sleep 0.5
    done
fi

# What is still mounted under DIR (volumes, root file systems), deepest first.
awk '{print $5}' /proc/self/mountinfo | grep "^$DIR/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
# The nodes' cgroup subtrees, deepest first (a cgroup goes once it has no processes), in
# cgroup v2's one hierarchy or each of v1's.
for hierarchy in /sys/fs/cgroup/ /sys/fs/cgroup/*/; do
    for root in "$hierarchy"tensorfleet-*; do
        [[ -d $root ]] || continue
        find "$root" -depth -type d -exec rmdir {} + 2>/dev/null
    done
done

"$HERE/host.sh" restore "$DIR" || log "could not restore everything (see above)"
if "$HERE/host.sh" compare "$DIR"; then
    log "stopped; the host is as found"
else
    log "stopped; the host differs from before (see above)"
    exit 1
fi
