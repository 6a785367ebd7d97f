#!/usr/bin/env bash
# `make images`: the operator and worker images from the Dockerfile, tagged with the workspace's
# version, exported as archives under target/images/ that `kind load image-archive` and
# `ctr images import` take, and their sizes printed.
#
# With a Docker engine: `docker build` of both targets with the Dockerfile's default bases (the
# binaries built in the image), then `docker save`.
# Without one (the development machines and CI): buildah (STORAGE_DRIVER=vfs,
# BUILDAH_ISOLATION=chroot: no daemon, no overlay mounts), with local bases in place of the
# registries' (which cannot be reached from here), made once and kept in buildah's store:
#   localhost/tensorfleet-base/debian:bookworm    mmdebstrap --variant=minbase bookworm
#   localhost/tensorfleet-base/cc:bookworm        glibc and libgcc alone (distroless/cc's kind)
#   localhost/tensorfleet-base/cuda:13.0-bookworm the Debian base with CUDA 13.0's NVRTC,
#                                                 cuBLAS(Lt) and NCCL from NVIDIA's pip wheels
# and the binaries built here (BINARIES=host), then `buildah push … oci-archive:`.
# Then each image runs its binary once (`buildah run`), and sshd checks its configuration.
#
# Environment: IMAGE_PREFIX (tensorfleet), IMAGE_TAG (the version), TENSORFLEET_IMAGES_OUT
# (target/images), TENSORFLEET_IMAGES_REBASE=1 makes the local bases again,
# TENSORFLEET_CUDA_IMAGE another CUDA 13 base for the worker (with Docker: the Dockerfile's
# CUDA_IMAGE).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
prefix=${IMAGE_PREFIX:-tensorfleet}
tag=${IMAGE_TAG:-$version}
out=${TENSORFLEET_IMAGES_OUT:-target/images}
wheels=${XDG_CACHE_HOME:-$HOME/.cache}/tensorfleet/images/wheels
mkdir -p "$out"
stage() { echo "== images: $SECONDS s: $*"; }

# The CUDA 13.0 libraries the worker dlopens, as NVIDIA publishes them on PyPI. NVRTC and NCCL
# are the versions .ci/requirements.txt pins for the tests; cuBLAS is CUDA 13.0's.
CUDA_WHEELS=(nvidia-cuda-nvrtc==13.0.88 nvidia-nccl-cu13==2.28.9 nvidia-cublas==13.0.2.14)

if docker info >/dev/null 2>&1; then
    for target in operator worker; do
        stage "docker build --target $target"
        docker build --target "$target" ${TENSORFLEET_CUDA_IMAGE:+--build-arg "CUDA_IMAGE=$TENSORFLEET_CUDA_IMAGE"} \
            --tag "$prefix/$target:$tag" .
        docker save --output "$out/$target-$tag.tar" "$prefix/$target:$tag"
    done
    ls -l "$out"/*-"$tag".tar
    exit 0
fi

if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
    stage "installing buildah and mmdebstrap (Debian packages)"
    apt-get update -qq && apt-get install -y --no-install-recommends buildah mmdebstrap >/dev/null
fi
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs} BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
work=$(mktemp -d /tmp/tensorfleet-images.XXXXXX)
trap 'rm -rf "$work"' EXIT

has_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }

# A base image from a root file system tarball.
from_tarball() {
    local name=$1 tarball=$2 c
    c=$(buildah from scratch)
    buildah add --quiet "$c" "$tarball" / >/dev/null
    buildah commit --quiet --rm "$c" "$name" >/dev/null
}

debian=localhost/tensorfleet-base/debian:bookworm
cc=localhost/tensorfleet-base/cc:bookworm
cuda=localhost/tensorfleet-base/cuda:13.0-bookworm
rebase=${TENSORFLEET_IMAGES_REBASE:-0}

if [[ $rebase == 1 ]] || ! has_image "$debian"; then
    stage "base $debian (mmdebstrap)"
    mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$work/debian.tar"
    from_tarball "$debian" "$work/debian.tar"
fi
if [[ $rebase == 1 ]] || ! has_image "$cc"; then
    # What distroless/cc holds: the C library, libgcc, time zones, /etc/services, a /tmp.
    stage "base $cc (mmdebstrap, packages extracted)"
    mmdebstrap --quiet --variant=extract --include=libc6,libgcc-s1,base-files,netbase,tzdata \
        --customize-hook='mkdir -p -m 1777 "$1/tmp"' bookworm "$work/cc.tar"
    from_tarball "$cc" "$work/cc.tar"
fi
if [[ $rebase == 1 ]] || ! has_image "$cuda"; then
    stage "base $cuda (CUDA libraries from ${CUDA_WHEELS[*]})"
    mkdir -p "$wheels" "$work/cuda"
    platforms=(manylinux2014_x86_64)
    for n in $(seq 17 28); do platforms+=("manylinux_2_${n}_x86_64"); done
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
        "${platforms[@]/#/--platform=}" --dest "$wheels" "${CUDA_WHEELS[@]}"
    for w in "${CUDA_WHEELS[@]}"; do
        file=$(ls "$wheels"/"$(echo "${w%%==*}" | tr - _)"-"${w##*==}"-*.whl | head -n 1)
        python3 - "$file" "$work/cuda" <<'EOF'
import sys, zipfile, os
# The shared libraries only (nvidia/*/lib/*.so*): no headers, static archives or Python.
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        parts = name.split("/")
        if len(parts) == 4 and parts[0] == "nvidia" and parts[2] == "lib" and ".so" in parts[3]:
            with open(os.path.join(sys.argv[2], parts[3]), "wb") as f:
                f.write(z.read(name))
EOF
    done
    c=$(buildah from "$debian")
    buildah copy --quiet "$c" "$work/cuda" /usr/local/cuda/lib64 >/dev/null
    buildah run "$c" -- sh -c 'echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/cuda.conf && ldconfig'
    buildah config --env NVIDIA_VISIBLE_DEVICES=all --env NVIDIA_DRIVER_CAPABILITIES=compute,utility "$c"
    buildah commit --quiet --rm "$c" "$cuda" >/dev/null
fi

# The two binaries' packages alone: the same selection, hence the same features, as `make test`'s
# `cargo test --workspace --exclude tensorfleet-e2e`, so after it nothing is compiled again.
stage "binaries (cargo build --release -p tensorfleet-worker -p tensorfleet-operator, on this bookworm host)"
cargo build --release --locked -p tensorfleet-worker -p tensorfleet-operator
rm -rf .images/bin && mkdir -p .images/bin
for b in tensorfleet-worker tensorfleet-operator; do strip -o ".images/bin/$b" "target/release/$b"; done

for target in operator worker; do
    image=$prefix/$target:$tag
    stage "buildah bud --target $target"
    buildah bud --quiet --layers=false --target "$target" --tag "$image" \
        --build-arg BINARIES=host --build-arg OPERATOR_BASE="$cc" --build-arg CUDA_IMAGE="$cuda" . >/dev/null
    # The archive names the image as Kubernetes does (docker.io/ before a name with no
    # registry), so that a kubelet finds it in containerd once imported.
    ref=$image
    [[ ${image%%/*} == *[.:]* || ${image%%/*} == localhost ]] || ref=docker.io/$image
    rm -f "$out/$target-$tag.tar"
    buildah push --quiet "$image" "oci-archive:$out/$target-$tag.tar:$ref"
done
buildah rmi --prune >/dev/null 2>&1 || echo "images: some intermediate stages are left in buildah's store (buildah rmi --prune)"

stage "each image runs its binary"
c=$(buildah from "$prefix/operator:$tag")
buildah run --user 65532:65532 "$c" -- /usr/local/bin/tensorfleet-operator --version
buildah rm "$c" >/dev/null
c=$(buildah from "$prefix/worker:$tag")
buildah run "$c" -- tensorfleet-worker --version
# No host key is baked into the image (the pods' come from each job's Secret).
if buildah run "$c" -- sh -c 'ls /etc/ssh/ssh_host_* 2>/dev/null || true' | grep -q .; then
    echo "images: the worker image holds ssh host keys (/etc/ssh/ssh_host_*): they would be every pod's" >&2
    exit 1
fi
echo "ssh host keys: none in the image"
# As the image's own user (mpiuser, 1000), as the pods run it by default: sshd takes a host key
# made here and checks its configuration; no file can make anyone another user.
[[ $(buildah run "$c" -- id -u) == 1000 ]] || { echo "images: the worker image does not run as user 1000" >&2; exit 1; }
buildah run "$c" -- sh -c 'mpirun --version | head -n 1; ssh-keygen -q -t ed25519 -N "" -f /tmp/hostkey &&
    /usr/sbin/sshd -t -h /tmp/hostkey && echo "sshd: configuration valid, as $(id -un)"'
setuid=$(buildah run --user 0:0 "$c" -- find / -xdev -type f -perm /6000)
[[ -z $setuid ]] || { echo "images: setuid or setgid files in the worker image: $setuid" >&2; exit 1; }
echo "setuid/setgid files: none"
for lib in libnvrtc.so.13 libcublasLt.so.13 libnccl.so.2; do
    buildah run "$c" -- sh -c "ldconfig -p | grep -q '$lib '" || { echo "images: $lib is not in the worker's ld cache" >&2; exit 1; }
    echo "$lib: in the ld cache"
done
buildah rm "$c" >/dev/null

stage "done"
for target in operator worker; do
    size=$(buildah images --format '{{.Size}}' "$prefix/$target:$tag")
    echo "$prefix/$target:$tag  $size image, $(du -h "$out/$target-$tag.tar" | cut -f1) archive  $out/$target-$tag.tar"
done
