#!/usr/bin/env bash
# Deletes the kind cluster of up.sh (nodes, volumes and loaded images with it). The images built
# on the host stay: `docker image rm tensorfleet/operator:<version> tensorfleet/worker:<version>`.
#
#   e2e/kind/down.sh
set -euo pipefail
# shellcheck source=e2e/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

need kind "install kind $KIND_VERSION (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
if cluster_exists; then
    kind delete cluster --name "$CLUSTER_NAME"
    log "deleted kind cluster $CLUSTER_NAME"
else
    log "there is no kind cluster $CLUSTER_NAME: nothing to delete"
fi
