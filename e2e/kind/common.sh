# Shared by up.sh, run-scenarios.sh and down.sh (sourced, not run): the cluster's name and
# context, the pinned versions, and the checks that name what is missing.
# shellcheck shell=bash disable=SC2034 # the variables are for the scripts that source this

KIND_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$KIND_DIR/../.." && pwd)

CLUSTER_NAME=${TENSORFLEET_KIND_CLUSTER:-tensorfleet-gpu}
CONTEXT=kind-$CLUSTER_NAME
# The operator's release, as e2e/cluster/up.sh installs it on the local cluster.
RELEASE=tensorfleet
OPERATOR_NAMESPACE=tensorfleet-system

# The versions these scripts were written against (README.md, "Prerequisites"). Others may work;
# up.sh says when the installed ones differ.
KIND_VERSION=v0.32.0
# Installed inside the kind nodes by up.sh (NVIDIA's apt repository, stable/deb).
NVIDIA_CTK_VERSION=1.19.1-1

# The images' tag: the workspace version, as `make images` tags them.
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n 1)
IMAGE_PREFIX=${IMAGE_PREFIX:-tensorfleet}
OPERATOR_IMAGE=$IMAGE_PREFIX/operator:$VERSION
WORKER_IMAGE=$IMAGE_PREFIX/worker:$VERSION

log() { echo "[kind/$(basename "$0") $(date +%H:%M:%S)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# need PROGRAM WHAT-TO-DO: fails naming the program and where to get it.
need() {
    command -v "$1" >/dev/null 2>&1 || die "'$1' is not installed or not on PATH: $2"
}

# kubectl and helm against this cluster only, whatever the current context is.
k() { kubectl --context "$CONTEXT" "$@"; }

cluster_exists() { kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; }

# The cluster's worker nodes (the GPU nodes), one name a line.
worker_nodes() { kind get nodes --name "$CLUSTER_NAME" | grep -- '-worker' | sort; }

# The most nvidia.com/gpu any node can give one pod (every pod of a job lands on one node).
max_node_gpus() {
    k get nodes -o jsonpath='{range .items[*]}{.status.allocatable.nvidia\.com/gpu}{"\n"}{end}' |
        awk 'BEGIN { m = 0 } $1 + 0 > m { m = $1 + 0 } END { print m }'
}
