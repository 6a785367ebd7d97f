#!/usr/bin/env bash
# The images every node needs besides tensorfleet's, made here since no registry can be reached:
# the pod sandbox (Kubernetes' own pause.c from the k8s.io/kubernetes module, linked static),
# CoreDNS and local-path-provisioner (the binaries e2e/control-plane/build.sh --nodes built), and
# the provisioner's helper (Debian's static busybox), each on an empty base, exported as OCI
# archives that `ctr images import` takes. Cached beside the binaries, by version.
#
#   DIR=$(e2e/nodes/images.sh BIN | tail -1)   # BIN: the output of build.sh --nodes
#
# The last line of stdout is the folder of the archives (pause.tar, coredns.tar,
# local-path.tar, busybox.tar); their image names are the *_IMAGE below (up.sh reads them from
# DIR/names).
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
BIN=${1:?"usage: images.sh BIN"}

K8S_VERSION=$("$BIN/kubelet" --version | awk '{print $2}')
COREDNS_VERSION=v$("$BIN/coredns" -version | sed -n 's/^CoreDNS-\([0-9.]*\)$/\1/p')
PAUSE_VERSION=3.10.1  # build/pause/Makefile's TAG at K8S_VERSION
PAUSE_IMAGE=registry.k8s.io/pause:$PAUSE_VERSION
COREDNS_IMAGE=registry.k8s.io/coredns/coredns:$COREDNS_VERSION
# (its binary does not know its version: build.sh's stamp does)
LOCAL_PATH_IMAGE=docker.io/rancher/local-path-provisioner:$(<"$BIN/.stamp-local-path")
BUSYBOX_IMAGE=localhost/tensorfleet-e2e/busybox:$(dpkg-query -W -f='${Version}' busybox-static 2>/dev/null | sed 's/^[0-9]*://' | tr '+~' '--')

out=$(dirname "$BIN")/images
stamp="$K8S_VERSION $PAUSE_IMAGE $COREDNS_IMAGE $LOCAL_PATH_IMAGE $BUSYBOX_IMAGE"
if [[ -f $out/names && $(. "$out/names"; echo "$STAMP") == "$stamp" ]]; then
    echo "$out"
    exit 0
fi
log() { echo "[nodes/images.sh $(date +%H:%M:%S)] $*" >&2; }
for tool in buildah gcc busybox; do
    command -v "$tool" >/dev/null || { log "$tool is not installed (make deps installs it)"; exit 1; }
done
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs} BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
work=$(mktemp -d /tmp/tensorfleet-node-images.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# scratch IMAGE ARCHIVE FILE DEST ENTRYPOINT-JSON: FILE alone on an empty base.
scratch() {
    local c
    c=$(buildah from scratch)
    buildah copy --quiet "$c" "$3" "$4" >/dev/null
    buildah config --entrypoint "$5" "$c"
    buildah commit --quiet --rm "$c" "$1" >/dev/null
    rm -f "$2"
    buildah push --quiet "$1" "oci-archive:$2:$1"
    buildah rmi "$1" >/dev/null
}

src=$(cd "$work" && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
[[ -f $src/build/pause/linux/pause.c ]] || { log "no build/pause/linux/pause.c in k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
log "pause $PAUSE_VERSION from $src/build/pause/linux/pause.c"
gcc -Os -static -DVERSION="v$PAUSE_VERSION" -o "$work/pause" "$src/build/pause/linux/pause.c"
strip "$work/pause"
scratch "$PAUSE_IMAGE" "$out/pause.tar" "$work/pause" /pause '["/pause"]'

log "coredns $COREDNS_VERSION"
scratch "$COREDNS_IMAGE" "$out/coredns.tar" "$BIN/coredns" /coredns '["/coredns"]'

log "local-path-provisioner ${LOCAL_PATH_IMAGE##*:}"
scratch "$LOCAL_PATH_IMAGE" "$out/local-path.tar" "$BIN/local-path-provisioner" /local-path-provisioner \
    '["/local-path-provisioner"]'

# busybox's applets as links (sh, mkdir, rm: what the provisioner's helper scripts run).
log "busybox ${BUSYBOX_IMAGE##*:}"
mkdir -p "$work/busybox/bin"
cp "$(command -v busybox)" "$work/busybox/bin/busybox"
for applet in $("$work/busybox/bin/busybox" --list); do
    [[ $applet == busybox ]] || ln -s busybox "$work/busybox/bin/$applet"
done
scratch "$BUSYBOX_IMAGE" "$out/busybox.tar" "$work/busybox" / '["/bin/sh"]'

printf '%s=%q\n' PAUSE_IMAGE "$PAUSE_IMAGE" COREDNS_IMAGE "$COREDNS_IMAGE" LOCAL_PATH_IMAGE "$LOCAL_PATH_IMAGE" \
    BUSYBOX_IMAGE "$BUSYBOX_IMAGE" STAMP "$stamp" >"$out/names"
echo "$out"
