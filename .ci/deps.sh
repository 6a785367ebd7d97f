#!/usr/bin/env bash
# Installs what `make test` and `make demo` need on a Debian bookworm machine that has a Rust
# toolchain: the Debian packages below (when missing) and the Python test oracles in .venv/.
# Safe to run again: with everything present it only checks, in well under a second.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=${EPOCHREALTIME//[!0-9]/}  # microseconds

# build-essential, pkg-config: the C toolchain some crates build with.
# python3-venv: the venv of the test oracles (onnx, onnxruntime, numpy).
# libopenmpi-dev, openmpi-bin, libclang-dev: MPI, and the libclang the mpi crate's bindgen needs.
# openssl: certificates of the test control plane (e2e/control-plane/up.sh).
# openssh-server, openssh-client, iproute2: the local cluster's pods (e2e/cluster/): sshd in the
# worker pods, ssh under the launcher's mpirun, and the pods' network namespaces and bridge.
APT_PACKAGES=(build-essential pkg-config python3-venv libopenmpi-dev openmpi-bin libclang-dev openssl
    openssh-server openssh-client iproute2
    # The real nodes' parts (e2e/nodes/) and the images' tools (e2e/images/, e2e/nodes/images.sh).
    containerd runc containernetworking-plugins iptables ipset nftables busybox-static buildah mmdebstrap)

REQUIREMENTS=.ci/requirements.txt
# ptxas, CUDA 13.0's PTX assembler: `make test` assembles the CUDA kernels' PTX for sm_80 and
# sm_90 with it, as the driver does on a GPU. Installed apart, without its dependencies (the
# rest of nvcc's compiler, 80 MB more), which ptxas does not use.
PTXAS_WHEEL=nvidia-cuda-nvcc==13.0.88
VENV=.venv
STAMP=$VENV/.tensorfleet-requirements.sha256
PIP_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/tensorfleet/pip
# Debian's interpreter, the one python3-venv serves; TENSORFLEET_BOOTSTRAP_PYTHON overrides it.
if [[ -n ${TENSORFLEET_BOOTSTRAP_PYTHON:-} ]]; then
    BOOTSTRAP_PYTHON=$TENSORFLEET_BOOTSTRAP_PYTHON
elif [[ -x /usr/bin/python3 ]]; then
    BOOTSTRAP_PYTHON=/usr/bin/python3
else
    BOOTSTRAP_PYTHON=python3
fi

# --- Debian packages -------------------------------------------------------------------------
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$pkg")
    fi
done
apt_note="${#APT_PACKAGES[@]} Debian packages present"
if ((${#missing[@]} > 0)); then
    if [[ $(id -u) -eq 0 ]]; then
        sudo=()
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo=(sudo)
    else
        echo "deps: missing Debian packages: ${missing[*]}" >&2
        echo "deps: install them as root, then run this again:" >&2
        echo "    sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine's package lists may be empty or stale.
    "${sudo[@]}" apt-get update -q
    "${sudo[@]}" apt-get install -y -q "${missing[@]}"
    apt_note="installed ${missing[*]}"
fi

# --- Python venv of the test oracles ---------------------------------------------------------
# The stamp covers the requirements and the interpreter, so either changing re-creates the venv.
want=$({ cat "$REQUIREMENTS"; echo "$PTXAS_WHEEL"; "$BOOTSTRAP_PYTHON" -c 'import sys; print(sys.version)'; } \
    | sha256sum | cut -d' ' -f1)
if [[ -x $VENV/bin/python && -f $STAMP && $(<"$STAMP") == "$want" ]]; then
    venv_note="$VENV up to date"
else
    echo "deps: creating $VENV from $REQUIREMENTS with $BOOTSTRAP_PYTHON"
    rm -rf "$VENV"
    "$BOOTSTRAP_PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --cache-dir "$PIP_CACHE" \
        --only-binary=:all: --requirement "$REQUIREMENTS"
    "$VENV/bin/python" -m pip install --quiet --cache-dir "$PIP_CACHE" --only-binary=:all: --no-deps "$PTXAS_WHEEL"
    "$VENV"/lib/python3*/site-packages/nvidia/cu13/bin/ptxas --version >/dev/null
    # The node tests are why onnx is pinned: fail here, not in the middle of `cargo test`.
    node_tests=$("$VENV/bin/python" .ci/onnx_node_tests_dir.py)
    "$VENV/bin/python" -c 'import numpy, onnx, onnxruntime'
    # Written last, so an interrupted install is redone on the next run.
    echo "$want" >"$STAMP"
    venv_note="created $VENV ($(find "$node_tests" -mindepth 1 -maxdepth 1 -type d | wc -l) ONNX node tests)"
fi

elapsed_ms=$(((${EPOCHREALTIME//[!0-9]/} - started) / 1000))
printf 'deps: ok: %s; %s; %d.%03ds\n' "$apt_note" "$venv_note" $((elapsed_ms / 1000)) $((elapsed_ms % 1000))
