#!/usr/bin/env bash
# Stops the control plane that up.sh started in DIR: TERM, then KILL after DOWN_GRACE seconds
# (default 5). Idempotent; state and logs stay in DIR. A pid is only signalled while its command
# line still names DIR, so a recycled pid is never hit.
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
[[ -d $1 ]] || exit 0
DIR=$(cd "$1" && pwd)
GRACE=${DOWN_GRACE:-5}
[[ -f $DIR/pids ]] || exit 0

ours() { # PID: alive (not a zombie) and started by up.sh for DIR
    local pid=$1 state
    [[ -r /proc/$pid/cmdline ]] || return 1
    state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$pid/status" 2>/dev/null) || return 1
    [[ $state != Z && -n $state ]] || return 1
    tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$DIR/"
}

pids=()
while read -r pid; do
    [[ $pid =~ ^[0-9]+$ ]] && pids=("$pid" "${pids[@]}")   # reverse: scheduler first, etcd last
done <"$DIR/pids"

live=()
for pid in "${pids[@]}"; do
    if ours "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        live+=("$pid")
    fi
done
(( ${#live[@]} )) || exit 0

for (( i = 0; ; i++ )); do
    left=()
    for pid in "${live[@]}"; do ours "$pid" && left+=("$pid"); done
    (( ${#left[@]} )) || exit 0
    (( i < GRACE * 5 )) || break
    sleep 0.2
done
for pid in "${left[@]}"; do
    echo "down.sh: pid $pid did not stop after ${GRACE}s, sending KILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
done
for _ in $(seq 50); do
    left2=()
    for pid in "${left[@]}"; do ours "$pid" && left2+=("$pid"); done
    (( ${#left2[@]} )) || exit 0
    sleep 0.1
done
echo "down.sh: still running: ${left2[*]}" >&2
exit 1
