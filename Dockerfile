# syntax=docker/dockerfile:1
# tensorfleet images. Two targets, built by `make images` (e2e/images/build.sh) with Docker
# where an engine answers and with buildah otherwise:
#   docker build --target operator -t tensorfleet/operator:VERSION .
#   docker build --target worker   -t tensorfleet/worker:VERSION .
#
# The bases are build arguments. The defaults come from registries (Docker Hub, gcr.io, NVIDIA's);
# where those cannot be reached, e2e/images/build.sh makes local stand-ins of the same kinds
# (Debian bookworm by mmdebstrap, the CUDA 13 libraries from NVIDIA's pip wheels) and passes
# them here, with BINARIES=host and the binaries it built on the host in .images/bin/.

# The Rust toolchain image of the cargo stage (BINARIES=cargo).
ARG RUST_IMAGE=rust:1-bookworm
# The operator's base: glibc and libgcc (what a Rust binary links), nothing else.
ARG OPERATOR_BASE=gcr.io/distroless/cc-debian12:nonroot
# The worker's base: the CUDA runtime libraries it loads when a GPU is present.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
# Where the binaries come from: cargo (built in the image) or host (copied from .images/bin/).
ARG BINARIES=cargo

# ---- binaries-cargo: both release binaries, from one workspace build in the image ---------------
FROM ${RUST_IMAGE} AS binaries-cargo
# libclang-dev and libopenmpi-dev: the mpi crate generates its bindings with bindgen against
# OpenMPI's headers; pkg-config finds them.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libclang-dev libopenmpi-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The cache mounts keep the crate registry and target/ between builds; the binaries are copied
# out because a cache mount is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p tensorfleet-worker -p tensorfleet-operator \
 && mkdir -p /out \
 && cp target/release/tensorfleet-worker target/release/tensorfleet-operator /out/

# ---- binaries-host: the same binaries, built on a bookworm host by e2e/images/build.sh ---------
FROM scratch AS binaries-host
COPY .images/bin/ /out/

# ---- binaries: the stage BINARIES names (BuildKit, Docker's builder since 23, and buildah skip
# the other; the legacy builder would build both and fail without .images/bin/) -----------------
FROM binaries-${BINARIES} AS binaries

# ---- operator: the controller alone, on a small base, not as root -----------------------------
# No shell, no package manager: a small attack surface for a pod that holds cluster credentials.
# 65532 is distroless' nonroot user; the local base has no user database, so it is numeric.
FROM ${OPERATOR_BASE} AS operator
COPY --from=binaries /out/tensorfleet-operator /usr/local/bin/tensorfleet-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/tensorfleet-operator"]

# ---- worker: one image for the launcher and the worker pods -----------------------------------
# The CUDA base brings the libraries the worker loads at run time when a GPU is present (it
# loads them dynamically and runs on CPUs without them): NVRTC, cuBLASLt, and NCCL's
# libnccl.so.2 (where a base lacks it, GPU collectives fall back to MPI with a warning). Its
# glibc must be the builder's (2.36, bookworm) or newer: NVIDIA's ubuntu24.04 image has 2.39.
FROM ${CUDA_IMAGE} AS worker
# openmpi-bin: mpirun on the launcher and the OpenMPI libraries every rank links (libmpi.so.40,
# the same soname as bookworm's, which the builder linked against).
# openssh-server / openssh-client: mpirun starts the ranks on the worker pods over ssh.
# The host keys openssh-server's install makes are removed: an image's keys would be every pod's
# (of every job, of every user of the image). The worker pods' sshd takes its host key from the
# job's Secret (the operator makes one per job); `ssh-keygen -A` makes keys where sshd is run by
# hand.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openmpi-bin openssh-server openssh-client ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub \
 && mkdir -p /run/sshd
# The pods' ssh keys come from a per-job Secret mounted by Kubernetes, whose file modes and
# owners sshd's StrictModes would reject; the hosts are the job's own pods, whose host keys are
# new on every start, so known_hosts cannot be kept.
RUN sed -i 's/^#\?StrictModes.*/StrictModes no/' /etc/ssh/sshd_config \
 && printf 'Host *\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n' \
      >> /etc/ssh/ssh_config
# The user the operator runs the pods as by default (spec.mpi.runAsUser: 1000), as the MPI
# Operator's images do: sshd then runs as this user on an unprivileged port, with no
# capabilities, and logs in only this user. Its password is "*" (no password, not locked: sshd
# refuses locked accounts when it can read /etc/shadow, as root can). Ubuntu's images have a
# user 1000 of their own ("ubuntu"), which gives the id up.
# No file keeps a setuid or setgid bit (su, mount, passwd, ssh-keysign...): nothing in a pod
# should become another user than the one it was started as.
RUN if u=$(getent passwd 1000); then userdel --remove "${u%%:*}" 2>/dev/null || true; fi \
 && if g=$(getent group 1000); then groupdel "${g%%:*}"; fi \
 && useradd --create-home --uid 1000 --user-group --shell /bin/bash mpiuser \
 && usermod --password '*' mpiuser \
 && find / -xdev -type f -perm /6000 -exec chmod ug-s {} +
COPY --from=binaries /out/tensorfleet-worker /usr/local/bin/tensorfleet-worker
# Not root unless asked (runAsUser: 0); numeric, so that the kubelet can tell runAsNonRoot holds.
USER 1000:1000
# The operator sets each pod's command (sshd on workers, mpirun on the launcher).
CMD ["tensorfleet-worker", "--help"]
