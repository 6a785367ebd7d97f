#!/usr/bin/env bash
# Builds a pinned Kubernetes control plane (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl), the nodes' kubelet, kube-proxy, CoreDNS, local-path-provisioner and kube-router, etcd
# and helm from their Go module sources, and caches the binaries.
#
#   BIN=$(e2e/control-plane/build.sh | tail -1)            # the control plane, etcd, helm
#   BIN=$(e2e/control-plane/build.sh --nodes | tail -1)    # and the nodes' parts (e2e/nodes/)
#
# The last line of stdout is the bin dir; progress goes to stderr. When every binary is cached
# for the pinned versions it returns at once. Cache root: $TENSORFLEET_CACHE, else
# ${XDG_CACHE_HOME:-$HOME/.cache}/tensorfleet.
set -euo pipefail

# Pinned versions. Changing one rebuilds only that component (see the stamps below).
K8S_VERSION=v1.34.4    # k8s.io/kubernetes; staging modules are replaced by their v0.34.4 tags
ETCD_VERSION=v3.6.16   # newest v3.6 patch (go list -m -versions go.etcd.io/etcd/server/v3)
HELM_VERSION=v3.22.0   # newest v3 stable (go list -m -versions helm.sh/helm/v3)
COREDNS_VERSION=v1.15.0  # the nodes' cluster DNS (go list -m -versions github.com/coredns/coredns)
# The plugins of CoreDNS that e2e/nodes/coredns.yaml's Corefile uses: the binary links only
# these (upstream's main links all it ships, cloud providers' SDKs and tracers included, which
# took 188 of a fresh machine's seconds; these take a third of that).
COREDNS_PLUGINS=(errors health ready kubernetes cache loop reload)
LOCAL_PATH_VERSION=v0.0.30  # the nodes' claims (github.com/rancher/local-path-provisioner; the proxy's newest)
# The nodes' NetworkPolicy enforcement (github.com/cloudnativelabs/kube-router/v2, its network
# policy controller only: iptables and ipsets). v2.1.0 is the only version the module proxy
# serves here; advisories are reported against it, so it runs only in the local test cluster,
# with its BGP router, service proxy, CNI and metrics off, and never ships in an image.
KUBE_ROUTER_VERSION=v2.1.0

K8S_MINOR=${K8S_VERSION#v1.}; K8S_MINOR=${K8S_MINOR%%.*}
STAGING_VERSION=v0.${K8S_VERSION#v1.}

CACHE_ROOT=${TENSORFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tensorfleet}
BIN=$CACHE_ROOT/k8s/$K8S_VERSION/bin

K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
# The nodes' parts (e2e/nodes/), from the same module and version, cached under their own stamp.
NODE_BINS=(kubelet kube-proxy)

# A component is cached when its binaries exist and its stamp names the pinned version.
# The stamp is written only after the binaries are in place.
stamp_ok() { # component version
    local f=$BIN/.stamp-$1 line=
    [[ -f $f ]] && read -r line <"$f" && [[ $line == "$2" ]]
}
k8s_cached()  { local b; for b in "${K8S_BINS[@]}"; do [[ -x $BIN/$b ]] || return 1; done; stamp_ok k8s "$K8S_VERSION"; }
node_cached() { local b; for b in "${NODE_BINS[@]}"; do [[ -x $BIN/$b ]] || return 1; done; stamp_ok node "$K8S_VERSION"; }
etcd_cached() { [[ -x $BIN/etcd ]] && stamp_ok etcd "$ETCD_VERSION"; }
helm_cached() { [[ -x $BIN/helm ]] && stamp_ok helm "$HELM_VERSION"; }
coredns_cached() { [[ -x $BIN/coredns ]] && stamp_ok coredns "$COREDNS_VERSION ${COREDNS_PLUGINS[*]}"; }
local_path_cached() { [[ -x $BIN/local-path-provisioner ]] && stamp_ok local-path "$LOCAL_PATH_VERSION"; }
kube_router_cached() { [[ -x $BIN/kube-router ]] && stamp_ok kube-router "$KUBE_ROUTER_VERSION"; }
NODES=0
[[ ${1:-} == --nodes ]] && NODES=1
nodes_cached() { (( ! NODES )) || { node_cached && coredns_cached && local_path_cached && kube_router_cached; }; }
all_cached()  { k8s_cached && etcd_cached && helm_cached && nodes_cached; }

if all_cached; then
    echo "$BIN"
    exit 0
fi

log() { echo "[build.sh $(date +%H:%M:%S)] $*" >&2; }

command -v go >/dev/null || { log "go not found in PATH"; exit 1; }
mkdir -p "$BIN"

# One build at a time per cache (parallel test runs may all start cold).
exec 9>"$CACHE_ROOT/k8s/.build.lock"
if ! flock -n 9; then
    log "another build.sh holds $CACHE_ROOT/k8s/.build.lock; waiting"
    flock 9
fi
if all_cached; then
    echo "$BIN"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tensorfleet-k8s-build.XXXXXX")
trap 'rm -rf "$WORK"; rm -f "$BIN"/.*.tmp.$$' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

export CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=mod
# The binaries are stripped (-s -w), so the compiler need not write the debug info the linker
# drops: -dwarf=false builds etcd in 52 s instead of 60 (empty Go cache, 2 cores, 2026-11-27).
STRIPPED=(-trimpath -gcflags=all=-dwarf=false)
# The compiler collects garbage a quarter as often (its heap grows to 5 times the live data, a
# few hundred MB at most here): etcd in 48 s instead of 55 (as above).
export GOGC=${GOGC:-400}
BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
T0=$SECONDS

# install_bin SRC NAME: atomically put SRC into $BIN/NAME (copy to a temp name, then rename).
install_bin() {
    local tmp=$BIN/.$2.tmp.$$
    cp "$1" "$tmp"
    chmod 0755 "$tmp"
    mv -f "$tmp" "$BIN/$2"
}
# quiet CMD...: run CMD, show its output without the download chatter; keep its exit status.
quiet() {
    local out rc=0
    out=$("$@" 2>&1) || rc=$?
    [[ -z $out ]] || grep -v '^go: \(downloading\|added\|upgraded\|finding\|found\)' <<<"$out" >&2 || true
    return $rc
}
write_stamp() { # component version
    local tmp=$BIN/.stamp-$1.tmp.$$
    echo "$2" >"$tmp"
    mv -f "$tmp" "$BIN/.stamp-$1"
}

# build_k8s STAMP BINARY...: the named commands of k8s.io/kubernetes at the pinned version.
build_k8s() {
    local component=$1; shift
    local bins=("$@")
    log "kubernetes $K8S_VERSION (${bins[*]}): preparing wrapper module"
    local mod=$WORK/k8s-$component gomod
    rm -rf "$WORK/k8s-out"
    mkdir -p "$mod" "$WORK/k8s-out"
    cd "$mod"
    go mod init tensorfleet.local/k8s-build >/dev/null 2>&1
    gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
    [[ -f $gomod ]] || { log "could not download k8s.io/kubernetes@$K8S_VERSION"; return 1; }
    local staging
    staging=$(awk '$2 == "=>" && $3 ~ /^\.\/staging\// {print $1}' "$gomod")
    [[ -n $staging ]] || { log "no staging replaces found in $gomod"; return 1; }
    log "replacing $(wc -w <<<"$staging") staging modules with their $STAGING_VERSION tags"
    local args=(-require="k8s.io/kubernetes@$K8S_VERSION") m
    for m in $staging; do args+=(-replace="$m=$m@$STAGING_VERSION"); done
    go mod edit "${args[@]}"
    # Upstream's godebug block (e.g. "godebug default=go1.24") keeps runtime behaviour as shipped.
    local godebug
    godebug=$(awk '/^godebug \(/ {b=1; next} b && /^\)/ {b=0; next} b {print $1} /^godebug [^(]/ {print $2}' "$gomod")
    for m in $godebug; do go mod edit -godebug="$m"; done
    local pkgs=() b
    for b in "${bins[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
    log "resolving dependencies (go get)"
    quiet go get "${pkgs[@]/%/@$K8S_VERSION}"
    # go get may not leave the godebug lines alone; re-apply them.
    for m in $godebug; do go mod edit -godebug="$m"; done
    local ld=() p
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld+=("-X $p.gitVersion=$K8S_VERSION" "-X $p.gitMajor=1" "-X $p.gitMinor=$K8S_MINOR"
             "-X $p.gitTreeState=clean" "-X $p.buildDate=$BUILD_DATE")
    done
    log "compiling ${bins[*]} (the slow part)"
    go build "${STRIPPED[@]}" -ldflags "-s -w ${ld[*]}" -o "$WORK/k8s-out/" "${pkgs[@]}"
    for b in "${bins[@]}"; do install_bin "$WORK/k8s-out/$b" "$b"; done
    write_stamp "$component" "$K8S_VERSION"
    log "kubernetes $K8S_VERSION (${bins[*]}) done ($((SECONDS - T0))s elapsed)"
}

build_etcd() {
    log "etcd $ETCD_VERSION: preparing wrapper module"
    local mod=$WORK/etcd
    mkdir -p "$mod"
    cd "$mod"
    go mod init tensorfleet.local/etcd-build >/dev/null 2>&1
    cat >main.go <<'EOF'
// Wrapper around etcd's server main: go.etcd.io/etcd/server/v3 uses relative replace
// directives, so it cannot be built with `go install` directly.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
    quiet go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    quiet go mod tidy
    log "compiling etcd"
    go build "${STRIPPED[@]}" -ldflags "-s -w" -o "$WORK/etcd-bin" .
    install_bin "$WORK/etcd-bin" etcd
    write_stamp etcd "$ETCD_VERSION"
    log "etcd $ETCD_VERSION done ($((SECONDS - T0))s elapsed)"
}

build_helm() {
    log "helm $HELM_VERSION: go install"
    local ld=(
        "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
        "-X helm.sh/helm/v3/internal/version.gitTreeState=clean"
        "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1"
        "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$K8S_MINOR"
        "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1"
        "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$K8S_MINOR"
    )
    mkdir -p "$WORK/helm-gobin"
    (cd "$WORK" && GOFLAGS= GOBIN=$WORK/helm-gobin quiet go install "${STRIPPED[@]}" -ldflags "-s -w ${ld[*]}" \
        "helm.sh/helm/v3/cmd/helm@$HELM_VERSION")
    install_bin "$WORK/helm-gobin/helm" helm
    write_stamp helm "$HELM_VERSION"
    log "helm $HELM_VERSION done ($((SECONDS - T0))s elapsed)"
}

# CoreDNS's own main with the plugins of COREDNS_PLUGINS only, the way CoreDNS documents
# choosing plugins at compile time; the directives' order (core/dnsserver) stays upstream's,
# and the module's requirements are upstream's go.mod (the wrapper requires nothing else).
build_coredns() {
    log "coredns $COREDNS_VERSION (plugins ${COREDNS_PLUGINS[*]}): preparing wrapper module"
    local mod=$WORK/coredns p
    mkdir -p "$mod"
    cd "$mod"
    go mod init tensorfleet.local/coredns-build >/dev/null 2>&1
    {
        printf '// CoreDNS with the plugins the local cluster uses (e2e/control-plane/build.sh).\n'
        printf 'package main\n\nimport (\n\t"github.com/coredns/coredns/coremain"\n\n'
        for p in "${COREDNS_PLUGINS[@]}"; do printf '\t_ "github.com/coredns/coredns/plugin/%s"\n' "$p"; done
        printf ')\n\nfunc main() { coremain.Run() }\n'
    } >main.go
    quiet go get "github.com/coredns/coredns@$COREDNS_VERSION"
    quiet go mod tidy
    log "compiling coredns"
    go build "${STRIPPED[@]}" -ldflags "-s -w" -o "$WORK/coredns-bin" .
    local listed
    listed=$("$WORK/coredns-bin" -plugins)
    for p in "${COREDNS_PLUGINS[@]}"; do
        grep -qxE "[[:space:]]*(dns[.])?$p" <<<"$listed" || { log "coredns lacks the plugin $p:"$'\n'"$listed"; return 1; }
    done
    install_bin "$WORK/coredns-bin" coredns
    write_stamp coredns "$COREDNS_VERSION ${COREDNS_PLUGINS[*]}"
    log "coredns $COREDNS_VERSION done ($((SECONDS - T0))s elapsed)"
}

# go_install STAMP VERSION MODULE BINARY: a module's main package, by go install.
go_install() {
    log "$1 $2: go install $3"
    mkdir -p "$WORK/$1-gobin"
    (cd "$WORK" && GOFLAGS= GOBIN=$WORK/$1-gobin quiet go install "${STRIPPED[@]}" -ldflags "-s -w" "$3@$2")
    install_bin "$WORK/$1-gobin/$4" "$4"
    write_stamp "$1" "$2"
    log "$1 $2 done ($((SECONDS - T0))s elapsed)"
}

k8s_cached  || build_k8s k8s "${K8S_BINS[@]}"
etcd_cached || build_etcd
helm_cached || build_helm
if (( NODES )); then
    node_cached || build_k8s node "${NODE_BINS[@]}"
    coredns_cached || build_coredns
    local_path_cached ||
        go_install local-path "$LOCAL_PATH_VERSION" github.com/rancher/local-path-provisioner local-path-provisioner
    kube_router_cached ||
        go_install kube-router "$KUBE_ROUTER_VERSION" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router kube-router
fi

log "all binaries in $BIN ($((SECONDS - T0))s)"
echo "$BIN"
