#!/usr/bin/env bash
# Brings up the kind cluster `tensorfleet-gpu` whose worker nodes see this machine's NVIDIA GPUs,
# with tensorfleet installed on it, ready for run-scenarios.sh:
#
#   1. checks the prerequisites (README.md), naming whatever is missing and how to fix it;
#   2. creates the cluster from kind-config.yaml (reuses it when it exists);
#   3. installs the NVIDIA Container Toolkit inside each worker node and makes its runtime the
#      default of the node's containerd, so that pods can be given GPUs;
#   4. builds the operator and worker images from the Dockerfile (make images) and loads their
#      archives into the nodes (kind load image-archive);
#   5. applies the device plugin (device-plugin.yaml) and waits until every worker advertises
#      nvidia.com/gpu, then runs one GPU pod (manifests/gpu-smoke.yaml);
#   6. installs the chart (charts/tensorfleet, values-kind.yaml) and waits for the operator.
#
#   e2e/kind/up.sh && e2e/kind/run-scenarios.sh && e2e/kind/down.sh
#
# Env: TENSORFLEET_KIND_SKIP_BUILD=1 uses the archives already built (target/images/, by `make
# images`);
# TENSORFLEET_CUDA_IMAGE=nvidia/cuda:<tag> builds the worker on another CUDA 13 base (the
# Dockerfile's CUDA_IMAGE; CUDA 13 needs a driver of 580 or newer);
# TENSORFLEET_KIND_CLUSTER renames the cluster.
set -euo pipefail
# shellcheck source=e2e/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# ---- 1. prerequisites -------------------------------------------------------------------------
need docker "install Docker Engine (https://docs.docker.com/engine/install/)"
docker info >/dev/null 2>&1 ||
    die "the Docker engine does not answer ('docker info' failed): start it (sudo systemctl start docker), or add $(id -un) to the docker group"
need kind "install kind $KIND_VERSION (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
need kubectl "install kubectl (https://kubernetes.io/docs/tasks/tools/)"
need helm "install helm 3 (https://helm.sh/docs/intro/install/)"
need nvidia-smi "install the NVIDIA driver; this script needs a machine with NVIDIA GPUs"
host_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
((host_gpus > 0)) || die "nvidia-smi sees no GPU ('nvidia-smi -L' lists none): check the driver with 'nvidia-smi'"
need nvidia-ctk "install the NVIDIA Container Toolkit (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/install-guide.html)"

runtime=$(docker info --format '{{.DefaultRuntime}}' 2>/dev/null || true)
[[ $runtime == nvidia ]] ||
    die "Docker's default runtime is '$runtime', not nvidia, so kind's nodes would get no GPU: run" \
        "'sudo nvidia-ctk runtime configure --runtime=docker --set-as-default && sudo systemctl restart docker'"
ctk_config=/etc/nvidia-container-runtime/config.toml
[[ -r $ctk_config ]] || die "$ctk_config is missing or unreadable: is the NVIDIA Container Toolkit installed?"
grep -Eq '^[[:space:]]*accept-nvidia-visible-devices-as-volume-mounts[[:space:]]*=[[:space:]]*true' "$ctk_config" ||
    die "$ctk_config does not set accept-nvidia-visible-devices-as-volume-mounts = true, which kind-config.yaml's GPU mounts need: run" \
        "'sudo nvidia-ctk config --in-place --set accept-nvidia-visible-devices-as-volume-mounts=true && sudo systemctl restart docker'"

driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
if [[ ${driver%%.*} -lt 580 ]]; then
    die "driver $driver is older than 580, which CUDA 13 (the libraries the worker loads) needs: update the driver"
fi
kind_version=$(kind version 2>/dev/null | awk 'NR == 1 { print $2 }')
[[ $kind_version == "$KIND_VERSION" ]] || log "note: kind is $kind_version; these scripts were written for $KIND_VERSION"
log "$host_gpus GPU(s), driver $driver; docker $(docker version --format '{{.Server.Version}}' 2>/dev/null)," \
    "kind $kind_version, $(nvidia-ctk --version 2>/dev/null | head -n 1)"

# ---- 2. the cluster ---------------------------------------------------------------------------
if cluster_exists; then
    log "kind cluster $CLUSTER_NAME exists: reusing it (e2e/kind/down.sh deletes it)"
else
    log "creating kind cluster $CLUSTER_NAME (kind-config.yaml)"
    kind create cluster --name "$CLUSTER_NAME" --config "$KIND_DIR/kind-config.yaml" --wait 300s
fi
mapfile -t WORKERS < <(worker_nodes)
((${#WORKERS[@]} > 0)) || die "kind cluster $CLUSTER_NAME has no worker nodes: delete it (e2e/kind/down.sh) and run this again"

# ---- 3. the toolkit inside the nodes ----------------------------------------------------------
for node in "${WORKERS[@]}"; do
    docker exec "$node" nvidia-smi -L 2>/dev/null | grep -q '^GPU ' ||
        die "kind node $node sees no GPU although the host has $host_gpus: Docker did not honour its mount of" \
            "/dev/null on /var/run/nvidia-container-devices/all; check that Docker's default runtime is nvidia and" \
            "accept-nvidia-visible-devices-as-volume-mounts = true in $ctk_config, restart Docker, then delete the" \
            "cluster (e2e/kind/down.sh) and run this again"
    installed=$(docker exec "$node" dpkg-query -W -f='${Version}' nvidia-container-toolkit 2>/dev/null || true)
    if [[ $installed != "$NVIDIA_CTK_VERSION" ]]; then
        log "$node: installing the NVIDIA Container Toolkit $NVIDIA_CTK_VERSION"
        docker exec -e "V=$NVIDIA_CTK_VERSION" -e DEBIAN_FRONTEND=noninteractive "$node" bash -euo pipefail -c '
            apt-get update -qq
            apt-get install -y -qq --no-install-recommends ca-certificates curl gnupg >/dev/null
            keyring=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
            curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey | gpg --batch --yes --dearmor -o "$keyring"
            curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list |
                sed "s#deb https://#deb [signed-by=$keyring] https://#" >/etc/apt/sources.list.d/nvidia-container-toolkit.list
            apt-get update -qq
            apt-get install -y -qq --no-install-recommends \
                "nvidia-container-toolkit=$V" "nvidia-container-toolkit-base=$V" \
                "libnvidia-container-tools=$V" "libnvidia-container1=$V" >/dev/null' ||
            die "$node: installing nvidia-container-toolkit=$NVIDIA_CTK_VERSION failed (see above); the node needs to reach nvidia.github.io"
    fi
    if ! docker exec "$node" containerd config dump 2>/dev/null | grep -Eq 'default_runtime_name = "nvidia"'; then
        log "$node: making the NVIDIA runtime containerd's default"
        docker exec "$node" nvidia-ctk runtime configure --runtime=containerd --set-as-default >/dev/null ||
            die "$node: 'nvidia-ctk runtime configure --runtime=containerd' failed"
        docker exec "$node" systemctl restart containerd
    fi
done
k wait --for=condition=Ready node --all --timeout=180s >/dev/null ||
    die "the nodes are not Ready after containerd restarted: kubectl --context $CONTEXT describe nodes"

# ---- 4. the images ----------------------------------------------------------------------------
# The archives `make images` writes (e2e/images/build.sh: docker build of both targets, then
# docker save), loaded as the local cluster imports them.
ARCHIVES=("$ROOT/target/images/operator-$VERSION.tar" "$ROOT/target/images/worker-$VERSION.tar")
if [[ ${TENSORFLEET_KIND_SKIP_BUILD:-0} == 1 ]]; then
    log "TENSORFLEET_KIND_SKIP_BUILD=1: using the archives already built"
else
    log "building $OPERATOR_IMAGE and $WORKER_IMAGE (make images; the first build takes a while)"
    IMAGE_PREFIX=$IMAGE_PREFIX IMAGE_TAG=$VERSION bash "$ROOT/e2e/images/build.sh"
fi
for archive in "${ARCHIVES[@]}"; do
    [[ -f $archive ]] || die "$archive does not exist: run without TENSORFLEET_KIND_SKIP_BUILD, or 'make images'"
done
log "loading the images into the nodes (kind load image-archive)"
for archive in "${ARCHIVES[@]}"; do
    kind load image-archive --name "$CLUSTER_NAME" "$archive"
done

# ---- 5. the device plugin ---------------------------------------------------------------------
log "applying the NVIDIA device plugin (device-plugin.yaml)"
k apply -n kube-system -f "$KIND_DIR/device-plugin.yaml" >/dev/null
k -n kube-system rollout status daemonset/nvidia-device-plugin --timeout=300s ||
    die "the device plugin did not start: kubectl --context $CONTEXT -n kube-system logs daemonset/nvidia-device-plugin"
deadline=$((SECONDS + 180))
for node in "${WORKERS[@]}"; do
    until gpus=$(k get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}') && ((${gpus:-0} > 0)); do
        ((SECONDS < deadline)) ||
            die "node $node advertises no nvidia.com/gpu: kubectl --context $CONTEXT -n kube-system logs -l app.kubernetes.io/name=nvidia-device-plugin"
        sleep 2
    done
    log "$node: nvidia.com/gpu $gpus"
done

log "running a GPU pod (manifests/gpu-smoke.yaml)"
k -n default delete pod gpu-smoke --ignore-not-found --wait=true >/dev/null
k -n default apply -f "$KIND_DIR/manifests/gpu-smoke.yaml" >/dev/null
deadline=$((SECONDS + 300))
phase=
until [[ $phase == Succeeded || $phase == Failed ]] || ((SECONDS >= deadline)); do
    sleep 2
    phase=$(k -n default get pod gpu-smoke -o jsonpath='{.status.phase}')
done
smoke_log=$(k -n default logs gpu-smoke 2>&1 || true)
seen=$(grep -c '^GPU ' <<<"$smoke_log" || true)
if [[ $phase != Succeeded || $seen != 1 ]]; then
    k -n default describe pod gpu-smoke >&2 || true
    die "the GPU smoke pod ended '${phase:-still pending}' and saw $seen GPU(s), not the 1 it asked for; its output: $smoke_log"
fi
k -n default delete pod gpu-smoke --wait=false >/dev/null
log "a pod asking for 1 GPU got it: $smoke_log"

# ---- 6. the operator --------------------------------------------------------------------------
log "helm upgrade --install $RELEASE (charts/tensorfleet, values-kind.yaml) into $OPERATOR_NAMESPACE"
helm upgrade --install "$RELEASE" "$ROOT/charts/tensorfleet" --kube-context "$CONTEXT" \
    --namespace "$OPERATOR_NAMESPACE" --create-namespace \
    -f "$KIND_DIR/values-kind.yaml" --set "image.tag=$VERSION" --set "workerImage.tag=$VERSION" \
    --wait --timeout 5m ||
    die "helm install failed: kubectl --context $CONTEXT -n $OPERATOR_NAMESPACE describe pods"
k wait --for=condition=Established crd/trainingjobs.tensorfleet.dev --timeout=60s >/dev/null
k -n "$OPERATOR_NAMESPACE" rollout status "deployment/$RELEASE" --timeout=180s ||
    die "the operator is not available: kubectl --context $CONTEXT -n $OPERATOR_NAMESPACE logs deployment/$RELEASE"

log "ready: kind cluster $CLUSTER_NAME (context $CONTEXT), ${#WORKERS[@]} GPU workers, up to $(max_node_gpus) GPUs per node," \
    "operator $OPERATOR_IMAGE, worker $WORKER_IMAGE"
log "next: e2e/kind/run-scenarios.sh"
