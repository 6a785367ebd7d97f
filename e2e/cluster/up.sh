#!/usr/bin/env bash
# Brings up the local end-to-end cluster in DIR: real nodes on this host (e2e/nodes/up.sh: the
# control plane, three kubelets with containerd, two CPU nodes and one with 2 nvidia.com/gpu,
# the CNI bridge, kube-proxy, CoreDNS and the local-path StorageClass) running the images
# `make images` built, and the operator installed with helm from its image, as on any cluster.
#
#   e2e/cluster/up.sh DIR          # then: KUBECONFIG=DIR/kubeconfig kubectl get nodes,pods -A
#   e2e/cluster/down.sh DIR
#
# Needs root, the images (target/images/{operator,worker}-<version>.tar: make images) and the
# control plane's and nodes' binaries (e2e/control-plane/build.sh --nodes).
# Env: TENSORFLEET_K8S_BIN, NODES (e2e/nodes/up.sh's), TENSORFLEET_IMAGES_OUT (target/images).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
log() { echo "[cluster/up.sh $(date +%H:%M:%S)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n 1)
images=${TENSORFLEET_IMAGES_OUT:-$ROOT/target/images}
IMAGES=""
for target in operator worker; do
    [[ -f $images/$target-$version.tar ]] || die "$images/$target-$version.tar is missing: run make images"
    IMAGES+="$images/$target-$version.tar "
done
BIN=${TENSORFLEET_K8S_BIN:-$("$ROOT/e2e/control-plane/build.sh" --nodes | tail -n 1)}
export TENSORFLEET_K8S_BIN=$BIN

failed=1
trap '(( failed )) && { log "stopping what was started (logs in $DIR/logs)"; "$HERE/down.sh" "$DIR" >&2 || true; }' EXIT

IMAGES=$IMAGES "$ROOT/e2e/nodes/up.sh" "$DIR"
export KUBECONFIG=$DIR/kubeconfig
kubectl() { "$BIN/kubectl" "$@"; }

log "helm install tensorfleet (charts/tensorfleet, image tensorfleet/operator:$version) into tensorfleet-system"
# The operator's namespace admits only pods that meet the "restricted" Pod Security Standard.
kubectl create namespace tensorfleet-system >/dev/null
kubectl label namespace tensorfleet-system pod-security.kubernetes.io/enforce=restricted >/dev/null
# On the node that keeps the cluster's services (CoreDNS, the provisioner), which no scenario
# loses.
system_node=$(sed -n 's/^SYSTEM_NODE=//p' "$DIR/env")
"$BIN/helm" install tensorfleet "$ROOT/charts/tensorfleet" --namespace tensorfleet-system \
    --set-string "nodeSelector.kubernetes\.io/hostname=$system_node" \
    --set logFormat=text --set image.pullPolicy=Never --wait --timeout 180s >"$DIR/logs/helm.log" 2>&1 || {
    cat "$DIR/logs/helm.log" >&2
    kubectl -n tensorfleet-system get pods -o wide >&2 || true
    kubectl -n tensorfleet-system logs -l app.kubernetes.io/name=tensorfleet --tail 20 >&2 || true
    die "helm install failed"
}
failed=0
log "ready: KUBECONFIG=$DIR/kubeconfig"
