#!/usr/bin/env bash
# Brings up the local end-to-end cluster in DIR: the control plane (e2e/control-plane/up.sh),
# the node agent playing the kubelet for three nodes (two CPU nodes, one with 2 nvidia.com/gpu)
# with its pod bridge and local-path StorageClass, and the operator installed with helm from
# charts/tensorfleet, running as a pod like on any cluster.
#
#   e2e/cluster/up.sh DIR          # then: KUBECONFIG=DIR/kubeconfig kubectl get nodes,pods -A
#   e2e/cluster/down.sh DIR
#
# Needs root (network namespaces, mounts), the release build of the workspace
# (cargo build --release), OpenMPI and OpenSSH (make deps), and the control plane's binaries
# (e2e/control-plane/build.sh). Env: TENSORFLEET_K8S_BIN, AGENT_NODES (the --node arguments).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
log() { echo "[cluster/up.sh $(date +%H:%M:%S)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "the node agent needs root (network namespaces and mounts)"
# ip and sshd live in sbin, which a non-login root shell may not have on PATH.
export PATH=$PATH:/usr/sbin:/sbin
for b in tensorfleet-node-agent tensorfleet-operator tensorfleet-worker; do
    [[ -x $ROOT/target/release/$b ]] || die "target/release/$b is missing: run cargo build --release"
done
for p in mpirun sshd ssh ip unshare; do
    command -v "$p" >/dev/null || die "$p is not installed: run make deps"
done
BIN=${TENSORFLEET_K8S_BIN:-$("$ROOT/e2e/control-plane/build.sh" | tail -n 1)}
export TENSORFLEET_K8S_BIN=$BIN

# One local cluster per machine: the bridge and the API proxy's address are the machine's.
if other=$(pgrep -f 'tensorfleet-node-agent --kubeconfig' | head -n 1) && [[ -n $other ]]; then
    die "a local cluster's node agent already runs (pid $other: $(tr '\0' ' ' </proc/$other/cmdline | grep -o -- '--kubeconfig [^ ]*')); stop it with e2e/cluster/down.sh DIR"
fi

failed=1
trap '(( failed )) && { log "stopping what was started (logs in $DIR/logs)"; "$HERE/down.sh" "$DIR" >&2 || true; }' EXIT

"$ROOT/e2e/control-plane/up.sh" "$DIR" >/dev/null
export KUBECONFIG=$DIR/kubeconfig
kubectl() { "$BIN/kubectl" "$@"; }

read -r -a NODES <<<"${AGENT_NODES:---node tf-node-0,cpu=8,memory=16Gi --node tf-node-1,cpu=8,memory=16Gi --node tf-gpu-0,cpu=8,memory=16Gi,gpu=2}"
log "node agent: ${NODES[*]}"
setsid "$ROOT/target/release/tensorfleet-node-agent" \
    --kubeconfig "$DIR/kubeconfig" --state "$DIR/agent" \
    --images "$HERE/images.yaml" --programs "$ROOT/target/release" \
    "${NODES[@]}" >"$DIR/logs/node-agent.log" 2>&1 </dev/null &
AGENT_PID=$!
echo "$AGENT_PID" >>"$DIR/pids"
echo "AGENT_PID=$AGENT_PID" >>"$DIR/env"

wait_until() { # SECONDS WHAT CMD...
    local deadline=$((SECONDS + $1)) what=$2; shift 2
    until "$@" >/dev/null 2>&1; do
        if ! kill -0 "$AGENT_PID" 2>/dev/null || (( SECONDS >= deadline )); then
            log "node agent log:"; tail -n 30 "$DIR/logs/node-agent.log" | sed 's/^/    /' >&2
            die "the node agent exited or timed out waiting for $what"
        fi
        sleep 0.5
    done
}
nodes_ready() {
    local want=$(( ${#NODES[@]} / 2 ))
    [[ $(kubectl get nodes -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -c True) -ge $want ]]
}
wait_until 60 "the nodes to be Ready" nodes_ready
wait_until 60 "the StorageClass" kubectl get storageclass tensorfleet-local

log "helm install tensorfleet (charts/tensorfleet) into tensorfleet-system"
"$BIN/helm" install tensorfleet "$ROOT/charts/tensorfleet" --namespace tensorfleet-system --create-namespace \
    --set logFormat=text --wait --timeout 180s >"$DIR/logs/helm.log" 2>&1 || {
    cat "$DIR/logs/helm.log" >&2
    kubectl -n tensorfleet-system get pods -o wide >&2 || true
    for f in "$DIR"/agent/pods/tensorfleet-system_*/logs/*/*.log; do [[ -f $f ]] && { log "$f:"; tail -n 20 "$f" >&2; }; done
    die "helm install failed"
}
failed=0
log "ready: KUBECONFIG=$DIR/kubeconfig (pods' files and logs under $DIR/agent/pods)"
