#!/usr/bin/env bash
# Stops the local cluster that up.sh started in DIR (e2e/nodes/down.sh: every container, the
# nodes, the control plane) and checks that the host is as it was found. Logs and the volumes'
# directories stay in DIR.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
exec "$HERE/../nodes/down.sh" "$1"
