#!/usr/bin/env bash
# What a user of the cluster up.sh made relies on, checked from the outside with kubectl: pods
# from the worker image start on the real nodes, `kubectl logs` and `kubectl exec` reach them,
# one pod resolves another by <hostname>.<subdomain>.<namespace>.svc and reaches it there and
# by IP across nodes, a pod reaches the API server through the `kubernetes` Service, and a pod
# asking for nvidia.com/gpu lands on the GPU node.
#
#   IMAGES=target/images/worker-0.1.0.tar e2e/nodes/up.sh DIR && e2e/nodes/check.sh DIR
#
# Env: WORKER_IMAGE (default docker.io/tensorfleet/worker:<workspace version>).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DIR=$(cd "${1:?usage: check.sh DIR}" && pwd)
set -a; . "$DIR/env"; set +a
kubectl() { "$TENSORFLEET_K8S_BIN/kubectl" "$@"; }
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n 1)
IMAGE=${WORKER_IMAGE:-docker.io/tensorfleet/worker:$version}
T0=$SECONDS
log() { echo "[nodes/check.sh +$((SECONDS - T0))s] $*" >&2; }
fail() {
    log "FAILED: $*"
    kubectl -n tf-check get pods -o wide >&2 || true
    # Why a pod stopped (Evicted, OOMKilled, ...) is in its status and the namespace's events.
    kubectl -n tf-check get pods -o jsonpath='{range .items[*]}{.metadata.name}: {.status.phase} {.status.reason} {.status.message}{"\n"}{end}' >&2 || true
    kubectl -n tf-check get events --sort-by=.lastTimestamp >&2 || true
    exit 1
}

read -r -a nodes <<<"$NODE_NAMES"
cpu_nodes=()
for n in "${nodes[@]}"; do [[ $n == *gpu* ]] || cpu_nodes+=("$n"); done
(( ${#cpu_nodes[@]} >= 2 )) || fail "check.sh needs two CPU nodes (NODES has ${NODE_NAMES})"

kubectl delete namespace tf-check --ignore-not-found --wait=true >/dev/null
kubectl create namespace tf-check >/dev/null
# pod NAME NODE [GPUS]: a worker-image pod that sleeps, pinned to NODE, with a stable DNS name.
pod() {
    local gpu=""
    [[ -n ${3:-} ]] && gpu="resources: {limits: {nvidia.com/gpu: $3}}"
    kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: tf-check, labels: {app: tf-check}}
spec:
  hostname: $1
  subdomain: peers
  ${2:+nodeName: $2}
  terminationGracePeriodSeconds: 0
  containers:
  - name: worker
    image: $IMAGE
    imagePullPolicy: Never
    command: [sh, -c, 'tensorfleet-worker --version; exec sleep infinity']
    $gpu
EOF
}
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Service
metadata: {name: peers, namespace: tf-check}
spec: {clusterIP: None, selector: {app: tf-check}}
EOF
pod a "${cpu_nodes[0]}"
pod b "${cpu_nodes[1]}"
kubectl -n tf-check wait --for=condition=Ready pod/a pod/b --timeout=120s >/dev/null || fail "pods a and b not Ready"
log "pods a (${cpu_nodes[0]}) and b (${cpu_nodes[1]}) Ready"

# Ready comes as the container starts (no probe), which can be before its first line is in
# the log: up to 30 s for it.
for _ in $(seq 30); do
    kubectl -n tf-check logs a | grep -q "tensorfleet-worker $version" && break
    sleep 1
done
kubectl -n tf-check logs a | grep -q "tensorfleet-worker $version" || fail "kubectl logs a does not show the worker's version"
log "kubectl logs: $(kubectl -n tf-check logs a | head -n 1)"
[[ $(kubectl -n tf-check exec a -- id -un) != "" ]] || fail "kubectl exec into a"
log "kubectl exec: ok"

name=b.peers.tf-check.svc.cluster.local
ip_b=$(kubectl -n tf-check get pod b -o jsonpath='{.status.podIP}')
resolved=$(kubectl -n tf-check exec a -- getent hosts "$name" | awk '{print $1}') || fail "a cannot resolve $name"
[[ $resolved == "$ip_b" ]] || fail "$name resolves to '$resolved', b's IP is $ip_b"
log "DNS: $name -> $resolved"
# A TCP connection from a to b by name, across nodes: sshd in b (as mpirun uses it), its banner
# read in a through bash's /dev/tcp.
# As the image's user, not root: a host key of its own, no pid file.
kubectl -n tf-check exec b -- sh -c 'ssh-keygen -q -t ed25519 -N "" -f /tmp/hostkey &&
    /usr/sbin/sshd -p 2222 -h /tmp/hostkey -o PidFile=none' || fail "sshd did not start in b"
banner=$(kubectl -n tf-check exec a -- bash -c "exec 3<>/dev/tcp/$name/2222; head -c 7 <&3") ||
    fail "a cannot connect to $name:2222"
[[ $banner == SSH-2.0 ]] || fail "a read '$banner' from $name:2222, not sshd's banner"
log "TCP a -> $name:2222 (sshd): $banner"

# The API server through the kubernetes Service (kube-proxy's translation to its address).
kubectl -n tf-check exec a -- bash -c 'exec 3<>/dev/tcp/kubernetes.default.svc.cluster.local/443' ||
    fail "a cannot reach the API server through the kubernetes Service"
log "API server through the kubernetes Service: connected"

pod g "" 1
kubectl -n tf-check wait --for=condition=Ready pod/g --timeout=120s >/dev/null || fail "the GPU pod g not Ready"
node_g=$(kubectl -n tf-check get pod g -o jsonpath='{.spec.nodeName}')
[[ $node_g == *gpu* ]] || fail "the pod asking for nvidia.com/gpu runs on $node_g"
log "nvidia.com/gpu pod scheduled on $node_g"

kubectl delete namespace tf-check --wait=true --timeout=60s >/dev/null || fail "namespace tf-check not deleted"
log "all checks passed"
