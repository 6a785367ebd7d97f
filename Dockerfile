# syntax=docker/dockerfile:1
# tensorfleet images. Two targets:
#   docker build --target operator -t tensorfleet/operator .   (or `make images` for both)
#   docker build --target worker   -t tensorfleet/worker .
# The development machines have no Docker engine, so this file is not built in CI.

# The worker's base; an ARG before the first FROM is what a later FROM can read.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

# ---- builder: both release binaries, from one workspace build ---------------------------------
FROM rust:1-bookworm AS builder
# libclang-dev and libopenmpi-dev: the mpi crate generates its bindings with bindgen against
# OpenMPI's headers; pkg-config finds them. Installed now so that enabling MPI changes no image.
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

# ---- operator: the controller alone, on a small base, not as root -----------------------------
# distroless/cc has glibc and libgcc (what a Rust binary links) and nothing else: no shell,
# no package manager, a small attack surface for a pod that holds cluster credentials.
FROM gcr.io/distroless/cc-debian12:nonroot AS operator
COPY --from=builder /out/tensorfleet-operator /usr/local/bin/tensorfleet-operator
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/tensorfleet-operator"]

# ---- worker: one image for the launcher and the worker pods -----------------------------------
# The CUDA runtime base brings the libraries the worker loads at run time when a GPU is present
# (it loads them dynamically and runs on CPUs without them): NVRTC, cuBLASLt, and NCCL's
# libnccl2 (libnccl.so.2; where a base lacks it, GPU collectives fall back to MPI with a warning). Its glibc (2.39) is newer than the
# builder's (2.36), which is the direction that works.
FROM ${CUDA_IMAGE} AS worker
# openmpi-bin: mpirun on the launcher and the OpenMPI libraries every rank links (libmpi.so.40,
# the same soname as bookworm's, which the builder linked against).
# openssh-server / openssh-client: mpirun starts the ranks on the worker pods over ssh.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openmpi-bin openssh-server openssh-client ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/sshd
# The pods' ssh keys come from a per-job Secret mounted by Kubernetes, whose file modes and
# owners sshd's StrictModes would reject; the hosts are the job's own pods, whose host keys are
# new on every start, so known_hosts cannot be kept.
RUN sed -i 's/^#\?StrictModes.*/StrictModes no/' /etc/ssh/sshd_config \
 && printf 'Host *\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n' \
      >> /etc/ssh/ssh_config
COPY --from=builder /out/tensorfleet-worker /usr/local/bin/tensorfleet-worker
# The operator sets each pod's command (sshd on workers, mpirun on the launcher).
CMD ["tensorfleet-worker", "--help"]
