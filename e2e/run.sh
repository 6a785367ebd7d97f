#!/usr/bin/env bash
# `make e2e`'s run, stage by stage, each stage's time printed: the nodes' binaries
# (e2e/control-plane/build.sh --nodes), the local cluster up (e2e/cluster/up.sh), the nodes
# checked from outside (e2e/nodes/check.sh), every scenario (e2e/scenarios/run.sh), and the
# cluster down with the host checked to be as found (e2e/cluster/down.sh). A failed run keeps
# the cluster's logs in its directory, which it prints.
#
#   e2e/run.sh          # all of it, in a new directory under /tmp
#   e2e/run.sh DIR      # on the cluster already up in DIR (.ci/test.sh starts it beside the
#                       # cargo tests), stopped at the end all the same
#
# Needs root and the images (make images). Env: CARGO.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ $# -le 1 ]] || { echo "usage: $0 [DIR]" >&2; exit 2; }

start=$SECONDS
stage() { echo "== e2e: $((SECONDS - start)) s: $*"; }
cluster=${1:-}
down() {
    local rc=$?
    stage "down"
    bash e2e/cluster/down.sh "$cluster" || rc=1
    if ((rc == 0)); then
        rm -rf "$cluster"
    else
        echo "e2e: logs of the cluster are in $cluster" >&2
    fi
    exit "$rc"
}
if [[ -z $cluster ]]; then
    stage "the nodes' binaries (e2e/control-plane/build.sh --nodes)"
    bin="$(bash e2e/control-plane/build.sh --nodes | tail -n 1)"
    cluster="$(mktemp -d /tmp/tensorfleet-e2e.XXXXXX)"
    trap down EXIT
    stage "up"
    TENSORFLEET_K8S_BIN="$bin" bash e2e/cluster/up.sh "$cluster"
else
    [[ -f $cluster/kubeconfig ]] || { echo "e2e: $cluster holds no cluster (no kubeconfig)" >&2; exit 2; }
    trap down EXIT
    stage "on the cluster up in $cluster"
fi
stage "the nodes from outside (e2e/nodes/check.sh)"
bash e2e/nodes/check.sh "$cluster"
stage "scenarios (e2e/scenarios/run.sh)"
TENSORFLEET_E2E_CLUSTER="$cluster" bash e2e/scenarios/run.sh
