#!/usr/bin/env bash
# A local cluster of real Kubernetes nodes in DIR, all on this host: the control plane
# (e2e/control-plane/up.sh with CP_REAL_NODES=1), then per node its own containerd (Debian's,
# with runc) and kubelet (built from k8s.io/kubernetes), pods on one CNI bridge (Debian's
# containernetworking-plugins: bridge + host-local, a /24 per node), one kube-proxy for the
# host's network, one kube-router enforcing NetworkPolicy on it (its network policy controller
# only: iptables and ipsets), CoreDNS behind the kube-dns Service, and claims from
# local-path-provisioner (the default StorageClass, tensorfleet-local). One node (tf-gpu-0)
# advertises nvidia.com/gpu.
# Images come from OCI archives imported into every node's containerd (e2e/nodes/images.sh).
#
#   e2e/nodes/up.sh DIR      # then: KUBECONFIG=DIR/kubeconfig kubectl get nodes,pods -A
#   e2e/nodes/down.sh DIR    # stops it and restores the host as found (e2e/nodes/host.sh)
#
# Needs root. Env: NODES (names, default "tf-node-0 tf-node-1 tf-gpu-0"), IMAGES (more OCI
# archives to import, e.g. target/images/*.tar from `make images`), UP_TIMEOUT (default 180).
# Prints each stage's time; DIR/env gains the nodes' settings (`set -a; . DIR/env; set +a`).
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
TIMEOUT=${UP_TIMEOUT:-180}
read -r -a NODE_NAMES <<<"${NODES:-tf-node-0 tf-node-1 tf-gpu-0}"
T0=$SECONDS
log() { echo "[nodes/up.sh $(date +%H:%M:%S) +$((SECONDS - T0))s] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "real nodes need root (containers, network namespaces, mounts)"
for tool in containerd containerd-shim-runc-v2 runc ctr iptables ipset ip /usr/lib/cni/bridge /usr/lib/cni/host-local; do
    command -v "$tool" >/dev/null || die "$tool is not installed (make deps installs it)"
done
if other=$(pgrep -f "kubelet --config=.*/nodes/.*/kubelet.yaml" | head -n 1) && [[ -n $other ]]; then
    die "a local cluster's kubelet already runs (pid $other); stop it with e2e/nodes/down.sh"
fi
# What a cluster whose processes died without down.sh (its session killed) left behind: its
# pods' network namespaces stay on the bridge and answer ARP for the addresses the new pods
# get, so a new pod's probes reach a dead one. Its directory is found by what stays mounted.
for stale in $(awk '{print $5}' /proc/self/mountinfo | sed -n 's#^\(/.*\)/nodes/[^/]*/\(kubelet\|containerd\)\(/.*\)\?$#\1#p' | sort -u); do
    [[ -d $stale/host-before ]] || continue
    log "stopping what a dead cluster left in $stale"
    "$HERE/down.sh" "$stale" >&2 || log "the host still differs from before $stale's cluster (see above)"
done
if ip link show tf-br0 >/dev/null 2>&1; then
    die "the bridge tf-br0 of a cluster that no longer runs is still up, with its pods' network namespaces" \
        "(ip netns list: cni-*); remove them (ip link delete tf-br0; ip netns delete NAME) or run e2e/nodes/down.sh on its directory"
fi
BIN=${TENSORFLEET_K8S_BIN:-$("$ROOT/e2e/control-plane/build.sh" --nodes | tail -n 1)}
for b in kubelet kube-proxy kube-router coredns; do [[ -x $BIN/$b ]] || die "$BIN/$b is missing: run e2e/control-plane/build.sh --nodes"; done
export TENSORFLEET_K8S_BIN=$BIN
ARCHIVES=$("$HERE/images.sh" "$BIN" | tail -n 1)
# shellcheck source=/dev/null
. "$ARCHIVES/names"

# Disk: each node keeps its own copy of every image, compressed and unpacked (about 2.5 times
# the archives), and the kubelets' eviction thresholds are set low (below), so a disk that
# fills during a run would fail its pods in ways far from the cause: say it here instead.
archive_mib=$(du -cm "$ARCHIVES"/{pause,coredns,local-path,busybox}.tar ${IMAGES:-} | tail -n 1 | cut -f 1)
need_mib=$(( ${#NODE_NAMES[@]} * archive_mib * 5 / 2 + 1024 ))
free_mib=$(df -Pm "$DIR" | awk 'NR == 2 {print $4}')
(( free_mib >= need_mib )) ||
    die "$DIR's filesystem has ${free_mib} MiB free; ${#NODE_NAMES[@]} nodes with these images (${archive_mib} MiB of archives) need about ${need_mib} MiB"

"$HERE/host.sh" snapshot "$DIR"
failed=1
trap '(( failed )) && { log "stopping what was started (logs in $DIR/logs)"; "$HERE/down.sh" "$DIR" >&2 || true; }' EXIT

log "control plane"
CP_REAL_NODES=1 "$ROOT/e2e/control-plane/up.sh" "$DIR" >/dev/null
set -a; . "$DIR/env"; set +a
kubectl() { "$BIN/kubectl" "$@"; }
ADDRESS=$APISERVER_ADDRESS
PKI=$DIR/pki
DNS_IP=10.0.0.10

SERVER=$APISERVER_URL
# shellcheck source=e2e/control-plane/pki.sh
. "$ROOT/e2e/control-plane/pki.sh"
start() { # NAME ARGS...: in its own session, logged, its pid kept for down.sh
    local name=$1; shift
    setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
    echo "$!" >>"$DIR/pids"
    echo "$!"
}
wait_until() { # WHAT LOG CMD...
    local what=$1 logfile=$2 deadline=$((SECONDS + TIMEOUT)); shift 2
    until "$@" >/dev/null 2>&1; do
        if (( SECONDS >= deadline )); then
            log "last lines of $logfile:"; tail -n 30 "$logfile" | sed 's/^/    /' >&2
            die "timed out after ${TIMEOUT}s waiting for $what"
        fi
        sleep 0.5
    done
}

CLIENT_EXT=$'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth'
SERVING_EXT=$'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth'
# containerd: every node's started, then the images imported into all of them at once (one
# after another took 25 s a node, most of it waiting on one core's decompression).
for name in "${NODE_NAMES[@]}"; do
    N=$DIR/nodes/$name
    rm -rf "$N" && mkdir -p "$N"/{containerd/root,containerd/state,cni/net.d,cni/ipam,kubelet,pod-logs,volume-plugins}
    log "$name: containerd"
    cat >"$N/containerd.toml" <<EOF
version = 2
root = "$N/containerd/root"
state = "$N/containerd/state"
[grpc]
  address = "$N/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$N/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # Root here lacks CAP_SYS_RESOURCE: without this every sandbox fails to start (see the note).
  restrict_oom_score_adj = true
  enable_cdi = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$N/cni/net.d"
EOF
    start "containerd-$name" containerd --config "$N/containerd.toml" >/dev/null
done
# Unpacked here, once per node: left to the first containers, concurrent pod starts each
# unpacked the layers again (the load bench's 50 jobs left ~25 copies of the worker image's
# /usr per node, 16 GB in two minutes).
import_images() { # NAME
    local sock=$DIR/nodes/$1/containerd.sock archive
    wait_until "$1's containerd" "$DIR/logs/containerd-$1.log" ctr -a "$sock" version
    for archive in "$ARCHIVES"/{pause,coredns,local-path,busybox}.tar ${IMAGES:-}; do
        ctr -a "$sock" -n k8s.io images import "$archive" >/dev/null || die "$1: could not import $archive"
    done
}
importers=()
for name in "${NODE_NAMES[@]}"; do
    import_images "$name" &
    importers+=($!)
done
for i in "${!importers[@]}"; do
    wait "${importers[$i]}" || die "${NODE_NAMES[$i]}: its images were not imported (above)"
done
log "images imported into every node's containerd"

for i in "${!NODE_NAMES[@]}"; do
    name=${NODE_NAMES[$i]}
    N=$DIR/nodes/$name
    log "$name: kubelet"
    sign "kubelet-$name" "/O=system:nodes/CN=system:node:$name" "$CLIENT_EXT"
    sign "kubelet-$name-serving" "/CN=$name" "$SERVING_EXT"$'\n'"subjectAltName=IP:$ADDRESS,DNS:$name"
    kubeconfig "$N/kubelet.kubeconfig" "kubelet-$name"
    # Each kubelet its own ports on the host's address, its own cgroup subtree and folders.
    port=$((10250 + 10 * i))
    for hierarchy in /sys/fs/cgroup/*/; do
        [[ -w $hierarchy && ! -L ${hierarchy%/} ]] && mkdir -p "$hierarchy/tensorfleet-$name"
    done
    cat >"$N/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ADDRESS
port: $port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $((port + 1))
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
tlsCertFile: "$PKI/kubelet-$name-serving.crt"
tlsPrivateKeyFile: "$PKI/kubelet-$name-serving.key"
containerRuntimeEndpoint: "unix://$N/containerd.sock"
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupRoot: /tensorfleet-$name
clusterDNS: [$DNS_IP]
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
podLogsDir: "$N/pod-logs"
volumePluginDir: "$N/volume-plugins"
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# Every node measures the host's one disk and memory, which the rest of the host shares: a
# percentage of a large disk (1% of 250 GB) evicted pods while gigabytes were free. Absolute
# floors keep eviction for a truly full disk; up.sh checks the space it needs before starting.
evictionHard: {memory.available: 50Mi, nodefs.available: 256Mi, imagefs.available: 256Mi, nodefs.inodesFree: "1000"}
EOF
    start "kubelet-$name" "$BIN/kubelet" --config="$N/kubelet.yaml" --kubeconfig="$N/kubelet.kubeconfig" \
        --root-dir="$N/kubelet" --hostname-override="$name" --node-ip="$ADDRESS" --v=1 >/dev/null
done

# The pods' network: one bridge for every node, on the cluster's /16 (so that each node's bridge
# address is the same gateway, and pods on different nodes meet on one segment), each node's
# pods addressed from the /24 the controller-manager gave it. containerd reads the file when it
# appears; until then the node is not Ready.
pod_cidr() { kubectl get node "$1" -o jsonpath='{.spec.podCIDR}' 2>/dev/null | grep .; }
for name in "${NODE_NAMES[@]}"; do
    wait_until "node $name's pod CIDR" "$DIR/logs/kubelet-$name.log" pod_cidr "$name"
    cidr=$(pod_cidr "$name")
    net=${cidr%.0/24}
    gateway=${CLUSTER_CIDR%.0.0/16}.0.1
    N=$DIR/nodes/$name
    cat >"$N/cni/net.d/10-tensorfleet.conflist.tmp" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "tensorfleet",
  "plugins": [
    {"type": "bridge", "bridge": "tf-br0", "isGateway": true, "hairpinMode": true, "ipMasq": false,
     "ipam": {"type": "host-local", "dataDir": "$N/cni/ipam", "routes": [{"dst": "0.0.0.0/0"}],
              "ranges": [[{"subnet": "$CLUSTER_CIDR", "gateway": "$gateway",
                           "rangeStart": "$net.2", "rangeEnd": "$net.254"}]]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
    mv "$N/cni/net.d/10-tensorfleet.conflist.tmp" "$N/cni/net.d/10-tensorfleet.conflist"
done

log "nodes Ready"
for name in "${NODE_NAMES[@]}"; do
    wait_until "node $name Ready" "$DIR/logs/kubelet-$name.log" \
        kubectl wait --for=condition=Ready "node/$name" --timeout=1s
done
# No device plugin can serve GPUs here: the GPU node advertises them in its status.
for name in "${NODE_NAMES[@]}"; do
    [[ $name == *gpu* ]] || continue
    kubectl patch node "$name" --subresource=status --type=merge \
        -p '{"status":{"capacity":{"nvidia.com/gpu":"2"},"allocatable":{"nvidia.com/gpu":"2"}}}' >/dev/null
done

log "kube-proxy"
sign kube-proxy "/CN=system:kube-proxy" "$CLIENT_EXT"
kubeconfig "$DIR/kube-proxy.kubeconfig" kube-proxy
cat >"$DIR/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$DIR/kube-proxy.kubeconfig"}
mode: iptables
bindAddress: $ADDRESS
hostnameOverride: ${NODE_NAMES[0]}
clusterCIDR: $CLUSTER_CIDR
nodePortAddresses: ["$ADDRESS/32"]
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# The host's sysctls stay as they are.
conntrack: {maxPerCore: 0, min: 0}
# Service traffic is masqueraded: a reply from a pod on the same bridge then goes back through
# the host, where the translation is undone.
iptables: {localhostNodePorts: false, masqueradeAll: true}
EOF
start kube-proxy "$BIN/kube-proxy" --config="$DIR/kube-proxy.yaml" >/dev/null
# Pods reach the API server through the kubernetes Service: CoreDNS's client, finding no route
# there at its first try, backed off for half a minute before it was ready (2026-11-27).
api_ip=${SERVICE_CIDR%.*}.1
wait_until "kube-proxy's rule for the kubernetes Service ($api_ip)" "$DIR/logs/kube-proxy.log" \
    sh -c "iptables -t nat -S KUBE-SERVICES | grep -q -- '-d $api_ip/32'"

# NetworkPolicy, enforced for every node's pods by one instance: it filters the pods whose
# host address is its node's, which all nodes here share. Pods on one bridge meet through it,
# so the filter sees them by br_netfilter (net.bridge.bridge-nf-call-iptables, the kernel's
# default) and the physdev match.
log "kube-router (network policies)"
sign kube-router "/CN=system:kube-router" "$CLIENT_EXT"
kubeconfig "$DIR/kube-router.kubeconfig" kube-router
kubectl apply -f "$HERE/kube-router.yaml" >/dev/null
start kube-router "$BIN/kube-router" --kubeconfig="$DIR/kube-router.kubeconfig" \
    --hostname-override="${NODE_NAMES[0]}" --run-firewall=true --run-router=false --run-service-proxy=false \
    --enable-cni=false --health-port=0 --metrics-port=0 --service-cluster-ip-range="$SERVICE_CIDR" \
    --iptables-sync-period=1m --v=1 >/dev/null

log "CoreDNS"
sed -e "s|@COREDNS_IMAGE@|$COREDNS_IMAGE|" -e "s|@DNS_IP@|$DNS_IP|" -e "s|@SYSTEM_NODE@|${NODE_NAMES[0]}|" \
    "$HERE/coredns.yaml" | kubectl apply -f - >/dev/null
wait_until "CoreDNS" "$DIR/logs/kubelet-${NODE_NAMES[0]}.log" \
    kubectl -n kube-system wait --for=condition=Available deployment/coredns --timeout=1s

log "local-path-provisioner (StorageClass tensorfleet-local, volumes in $DIR/volumes)"
mkdir -p "$DIR/volumes"
sed -e "s|@PROVISIONER_IMAGE@|$LOCAL_PATH_IMAGE|" -e "s|@HELPER_IMAGE@|$BUSYBOX_IMAGE|" -e "s|@SYSTEM_NODE@|${NODE_NAMES[0]}|" \
    -e "s|@VOLUMES@|$DIR/volumes|" "$HERE/local-path.yaml" | kubectl apply -f - >/dev/null
wait_until "local-path-provisioner" "$DIR/logs/kubelet-${NODE_NAMES[0]}.log" \
    kubectl -n local-path-storage wait --for=condition=Available deployment/local-path-provisioner --timeout=1s

{
    printf '%s=%q\n' NODE_NAMES "${NODE_NAMES[*]}" DNS_IP "$DNS_IP" NODE_IMAGES "$ARCHIVES" SYSTEM_NODE "${NODE_NAMES[0]}"
    for name in "${NODE_NAMES[@]}"; do
        printf 'CONTAINERD_%s=%q\n' "$(tr a-z- A-Z_ <<<"$name")" "$DIR/nodes/$name/containerd.sock"
    done
} >>"$DIR/env"
failed=0
log "ready: ${#NODE_NAMES[@]} nodes; KUBECONFIG=$DIR/kubeconfig"
