#!/usr/bin/env bash
# Stops the local cluster that up.sh started in DIR: the node agent (its containers go with it)
# and the control plane, then removes the pods' network namespaces and the bridge. Logs and the
# volumes' directories stay in DIR.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
"$HERE/../control-plane/down.sh" "$1"
for ns in $(ip netns list 2>/dev/null | awk '/^tf-/ {print $1}'); do
    ip netns delete "$ns" 2>/dev/null || true
done
ip link delete "${AGENT_BRIDGE:-tf0}" 2>/dev/null || true
