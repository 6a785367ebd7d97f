#!/usr/bin/env bash
# `make test`: every check, one stage after another; the time of each stage is printed at the
# end, whether the run passed or not (a failed stage is marked and ends the run).
#
# The node tests are the ONNX backend suite shipped inside the venv's onnx package. The
# operator's tests run against a real control plane started here for the duration of the run
# (a plain `cargo test` ignores them: they need it). The GPU tests run where nvidia-smi finds
# GPUs; elsewhere the run says they did not.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARGO=${CARGO:-cargo}
MAKE=${MAKE:-make}

# Clippy lints the workspace's crates while they are built for the tests (clippy-driver as the
# workspace's rustc, warnings denied) instead of in a `cargo clippy` of its own, which would
# type-check every dependency a second time (5 of a fresh run's minutes). Dependencies keep
# their lints capped (cargo passes them --cap-lints). Every cargo command of the run shares
# these settings, so the images and the e2e crate reuse the one build; the tests and images
# need no debug info (the release profile keeps line tables for profiles).
driver="$(rustc --print sysroot)/bin/clippy-driver"
if [[ ! -x $driver ]]; then
    echo "test: clippy-driver is not in $(rustc --print sysroot)/bin: rustup component add clippy" >&2
    exit 1
fi
export RUSTC_WORKSPACE_WRAPPER=$driver RUSTFLAGS="-D warnings" CARGO_PROFILE_RELEASE_DEBUG=0

times=()
started=$SECONDS
# A stage's function runs as the left side of `||`, where bash ignores `set -e` (in the
# subshells and jobs it starts too): every function below chains its commands with && or
# `|| return`/`|| exit`, so that a failed command fails its stage.
stage() {
    local name=$1 t0=$SECONDS status=0
    shift
    echo "== test: $name"
    "$@" || status=$?
    local mark=""
    if ((status)); then mark="  FAILED (exit $status)"; fi
    times+=("$(printf '%-40s %5d s%s' "$name" $((SECONDS - t0)) "$mark")")
    if ((status)); then exit "$status"; fi
}
# The control plane of the cargo tests while it runs: stopped at the end whatever happens.
cluster=""
stop_control_plane() {
    if [[ -n $cluster ]]; then
        bash e2e/control-plane/down.sh "$cluster" && rm -rf "$cluster"
        cluster=""
    fi
}
# The e2e cluster, started beside the cargo tests (below); e2e/run.sh stops it at the end of its
# stage, and summary() where the run ends before that.
e2e_cluster=""
stop_e2e_cluster() {
    if [[ -n $e2e_cluster ]]; then
        bash e2e/cluster/down.sh "$e2e_cluster" || true
        echo "test: the e2e cluster's logs are in $e2e_cluster"
        e2e_cluster=""
    fi
}
# A job run beside a stage's foreground (one at a time), its output kept in a log shown where it
# fails; summary() stops it where the run ends first.
beside_pid="" beside_log=""
start_beside() { # log command...
    beside_log=$1
    shift
    mkdir -p "$(dirname "$beside_log")"
    "$@" >"$beside_log" 2>&1 &
    beside_pid=$!
}
await_beside() { # what it was, for the message
    local pid=$beside_pid
    beside_pid=""
    if wait "$pid"; then return 0; fi
    echo "test: $1 failed beside the stage:" >&2
    tail -n 40 "$beside_log" >&2
    return 1
}
kill_tree() {
    local child
    for child in $(pgrep -P "$1"); do kill_tree "$child"; done
    kill "$1" 2>/dev/null || true
}
summary() {
    if [[ -n $beside_pid ]]; then kill_tree "$beside_pid"; fi
    stop_control_plane
    stop_e2e_cluster
    echo "== test: stage times"
    printf '  %s\n' "${times[@]}"
    printf '  %-40s %5d s\n' total $((SECONDS - started))
}
trap summary EXIT

helm_checks() {
    local bin
    bin="$(bash e2e/control-plane/build.sh | tail -n 1)" &&
        "$bin/helm" lint --strict charts/tensorfleet &&
        "$bin/helm" template tensorfleet charts/tensorfleet >/dev/null &&
        "$bin/helm" template tensorfleet charts/tensorfleet --set 'watchNamespaces={team-a,team-b}' >/dev/null
}

# Every cargo test of the workspace but the end-to-end crate's, with what they need around them.
cargo_tests() {
    local venv=$PWD/.venv status=0
    cluster="$(mktemp -d /tmp/tensorfleet-test-cluster.XXXXXX)"
    TENSORFLEET_K8S_BIN="$(bash e2e/control-plane/build.sh | tail -n 1)" bash e2e/control-plane/up.sh "$cluster" >/dev/null ||
        return
    (
        export TENSORFLEET_PYTHON=$venv/bin/python TENSORFLEET_TEST_KUBECONFIG=$cluster/kubeconfig
        TENSORFLEET_ONNX_NODE_TESTS="$("$venv/bin/python" .ci/onnx_node_tests_dir.py)"
        cuda_libs="$(echo "$venv"/lib/python3*/site-packages/nvidia/{cu13,nccl}/lib | tr ' ' :)"
        TENSORFLEET_PTXAS="$(echo "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/ptxas)"
        export TENSORFLEET_ONNX_NODE_TESTS TENSORFLEET_PTXAS
        export LD_LIBRARY_PATH="$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        run=("$CARGO" test --workspace --release --exclude tensorfleet-e2e --)
        "${run[@]}" --include-ignored --skip on_the_gpu --skip on_two_gpus || exit
        gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
        if ((gpus >= 1)); then
            "${run[@]}" --ignored on_the_gpu || exit
        else
            echo "test: no GPU here (nvidia-smi finds none): the tests ignored as needing one (on_the_gpu) did not run"
        fi
        if ((gpus >= 2)); then
            "${run[@]}" --ignored on_two_gpus || exit
        else
            echo "test: fewer than 2 GPUs here: the tests ignored as needing 2 (on_two_gpus) did not run"
        fi
    ) || status=$?
    stop_control_plane
    return "$status"
}

# The nodes' Go builds, the images and the e2e cluster's start need nothing the tests make, and
# the tests leave a core idle much of the time (NVRTC and ptxas one process at a time, the
# operator's tests waiting on the API server): they are made beside the tests, their output kept
# for a failure. The cluster, once up, idles until its stage.
e2e_builds_and_cluster() {
    local bin
    bin="$(bash e2e/control-plane/build.sh --nodes | tail -n 1)" &&
        "$MAKE" --no-print-directory images &&
        TENSORFLEET_K8S_BIN="$bin" bash e2e/cluster/up.sh "$e2e_cluster"
}
tests_and_e2e_builds() {
    local status=0
    e2e_cluster="$(mktemp -d /tmp/tensorfleet-e2e.XXXXXX)"
    start_beside target/e2e-builds.log e2e_builds_and_cluster
    cargo_tests || status=$?
    if await_beside "the nodes' Go builds, the images or the e2e cluster's start"; then
        grep '^== images\|^\[cluster/up.sh' "$beside_log" || true
    else
        status=1
    fi
    return "$status"
}

stage "deps (.ci/deps.sh)" bash .ci/deps.sh
stage "rustfmt" "$CARGO" fmt --all -- --check
# Every target of the workspace, the e2e crate's tests (its stage runs them) and load bench
# (make bench-load's) among them, in one cargo command, so that the e2e crate compiles beside
# the worker's test binaries instead of after them: one build for every later stage. The
# control plane's Go builds (the operator's tests and helm need them) run beside it: on two
# cores each leaves the other's single-threaded stretches (rustc's front end of a crate, Go's
# links) a core to fill.
build_every_target() {
    local status=0
    start_beside target/control-plane-build.log bash e2e/control-plane/build.sh
    "$CARGO" test --workspace --release --all-targets --no-run || status=$?
    if await_beside "the control plane's Go builds"; then
        grep '^\[build.sh' "$beside_log" || true
    else
        status=1
    fi
    return "$status"
}
stage "build and clippy, beside it the control plane's Go builds" build_every_target
stage "helm lint" helm_checks
stage "cargo tests, beside them e2e's builds and cluster" tests_and_e2e_builds
e2e_on_the_cluster() {
    local dir=$e2e_cluster
    e2e_cluster="" # e2e/run.sh stops it, whatever happens
    bash e2e/run.sh "$dir"
}
stage "e2e (scenarios on the cluster)" e2e_on_the_cluster
