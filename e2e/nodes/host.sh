#!/usr/bin/env bash
# The host state that real nodes change (../shared/notes/real-kubernetes-node.md lists it): a
# snapshot before e2e/nodes/up.sh starts anything, a restore and a comparison after down.sh has
# stopped everything.
#
#   e2e/nodes/host.sh snapshot DIR   # writes DIR/host-before/
#   e2e/nodes/host.sh restore DIR    # puts back what the snapshot holds, removes what it lacks
#   e2e/nodes/host.sh compare DIR    # exit 1, naming each difference, unless the host is as found
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin

mode=${1:?"usage: host.sh snapshot|restore|compare DIR"}
dir=${2:?"usage: host.sh snapshot|restore|compare DIR"}
before=$dir/host-before

# The sysctls the kubelet sets (no opt-out short of failing) and the bridge plugin's forwarding.
SYSCTLS=(vm.overcommit_memory kernel.panic kernel.panic_on_oops net.ipv4.ip_forward)
# Fixed paths the kubelet, containerd's shims and the CNI plugins create whatever their roots.
PATHS=(/var/lib/kubelet /var/log/containers /var/log/pods /var/lib/cni /run/netns /run/containerd /opt/containerd)
BRIDGE=tf-br0

# A rule set as iptables-save (or ip6tables-save) prints it, without comments and counters.
rules() { "$1" 2>/dev/null | grep -v '^#' | sed 's/\[[0-9]*:[0-9]*\]//' || true; }
# The ipsets' names (kube-router's network policies keep their pods' addresses in sets).
ipsets() { if command -v ipset >/dev/null; then ipset list -n 2>/dev/null | sort; fi; }

# What is compared: the sysctls' values, the rule sets (counters dropped), the ipsets' names,
# the links and mount points, and which fixed paths exist.
state() { # OUT
    mkdir -p "$1"
    local s
    for s in "${SYSCTLS[@]}"; do echo "$s = $(sysctl -n "$s")"; done >"$1/sysctls"
    rules iptables-save >"$1/iptables"
    rules ip6tables-save >"$1/ip6tables"
    ipsets >"$1/ipsets"
    ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort >"$1/links"
    awk '{print $5}' /proc/self/mountinfo | sort >"$1/mounts"
    local p
    for p in "${PATHS[@]}"; do [[ -e $p ]] && echo "$p"; done >"$1/paths" || true
    if command -v nft >/dev/null; then nft list tables | sort >"$1/nft-tables"; else : >"$1/nft-tables"; fi
}

case $mode in
snapshot)
    rm -rf "$before"
    state "$before"
    ;;
restore)
    [[ -d $before ]] || { echo "host.sh: no snapshot in $before" >&2; exit 1; }
    while read -r name _ value; do
        [[ $(sysctl -n "$name") == "$value" ]] || sysctl -q -w "$name=$value"
    done <"$before/sysctls"
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE"
    # The rule sets as found: kube-proxy's and the kubelet's chains go with the rest.
    if ! diff -q <(rules iptables-save) "$before/iptables" >/dev/null; then
        if [[ -s $before/iptables ]]; then iptables-restore <"$before/iptables"; fi
    fi
    if ! diff -q <(rules ip6tables-save) "$before/ip6tables" >/dev/null; then
        if [[ -s $before/ip6tables ]]; then ip6tables-restore <"$before/ip6tables"; fi
    fi
    # iptables-nft leaves the tables it made (empty) behind; nft removes those not there before.
    if command -v nft >/dev/null; then
        comm -13 "$before/nft-tables" <(nft list tables | sort) | while read -r _ family name; do
            nft delete table "$family" "$name"
        done
    fi
    # The sets not there before, once no rule refers to them.
    comm -13 "$before/ipsets" <(ipsets) | while read -r set; do ipset destroy "$set"; done
    # The fixed paths that were not there before, and what is still mounted under them.
    for p in "${PATHS[@]}"; do
        grep -qxF "$p" "$before/paths" && continue
        [[ -e $p ]] || continue
        { awk '{print $5}' /proc/self/mountinfo | grep "^$p/" || true; } | sort -r | while read -r m; do umount -l "$m"; done
        rm -rf "$p"
    done
    ;;
compare)
    [[ -d $before ]] || { echo "host.sh: no snapshot in $before" >&2; exit 1; }
    after=$dir/host-after
    rm -rf "$after"
    state "$after"
    status=0
    for f in sysctls iptables ip6tables ipsets links mounts paths nft-tables; do
        if ! diff -u "$before/$f" "$after/$f" >"$dir/host-diff-$f" 2>&1; then
            echo "host.sh: $f differ from before the cluster started:" >&2
            sed 's/^/    /' "$dir/host-diff-$f" >&2
            status=1
        else
            rm -f "$dir/host-diff-$f"
        fi
    done
    exit $status
    ;;
*)
    echo "host.sh: the mode is snapshot, restore or compare, not '$mode'" >&2
    exit 2
    ;;
esac
