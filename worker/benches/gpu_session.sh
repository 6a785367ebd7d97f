#!/usr/bin/env bash
# What a session lent a GPU machine runs there (the `device` tool), from the repository root:
# issue 7's checks that need a GPU, or the GPT-2 124M benchmark. `make gpu-bundle` builds what
# it needs, here, into .gpu-bundle/; each call carries that folder:
#
#   run(command="bash worker/benches/gpu_session.sh check", carry=[".gpu-bundle"])
#   run(command="bash worker/benches/gpu_session.sh bench", carry=[".gpu-bundle"])
#
# check: the GPU-vs-CPU training tests and NCCL's one-rank communicator (tests/cuda_backend.rs),
# then the ONNX node tests on the GPU. bench: worker/benches/gpu_gpt2_124m.py next to PyTorch
# eager and torch.compile (arguments after the mode go to it, e.g. --micro-batches 16,8 to try
# fewer sizes; the bench also times tensorfleet with TENSORFLEET_CUDA_ATTENTION=warp, and
# profiles that run where the default one fails). Logs and results go to $OUT, or to gpu-session/
# where OUT is unset. Each mode is meant to fit one call (10 minutes); neither has run on a GPU
# yet. Should the tensor-core attention fail the check, TENSORFLEET_CUDA_ATTENTION=warp in the
# command runs everything on the warp kernels without a rebuild.
set -euo pipefail
mode=${1:?"usage: gpu_session.sh check|bench [benchmark arguments]"}
shift
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bundle=.gpu-bundle
[[ -f $bundle/built-at ]] || { echo "gpu_session: no $bundle here; run 'make gpu-bundle' and carry it" >&2; exit 2; }
out=${OUT:-gpu-session}
mkdir -p "$out"

# CUDA 13's libraries as pip installs them beside the machine's PyTorch (cuBLASLt, NVRTC, NCCL);
# the driver's libcuda is the system's.
libs=$(python3 -c 'import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = spec.submodule_search_locations if spec else []
print(":".join(sorted({d for r in roots for d in glob.glob(os.path.join(r, "*", "lib"))})))')
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The test binaries find their sources (the known node-test failures) where they were built.
built=$(<"$bundle/built-at")
if [[ ! -e $built/worker ]]; then
    mkdir -p "$built"
    ln -sfn "$PWD/worker" "$built/worker"
fi
{ nvidia-smi || true; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; } >"$out/machine.txt" 2>&1

case $mode in
check)
    nodes=$(mktemp -d)
    tar xzf "$bundle/onnx-node-tests.tgz" -C "$nodes"
    export TENSORFLEET_ONNX_NODE_TESTS=$nodes/node TENSORFLEET_REQUIRE_NCCL=1 TENSORFLEET_REQUIRE_NVRTC=1
    status=0
    "$bundle/cuda_backend" --test-threads 1 --nocapture 2>&1 | tee "$out/cuda_backend.log" || status=1
    "$bundle/onnx_node_tests" --exact onnx_backend_node_tests_on_the_gpu --nocapture 2>&1 \
        | tee "$out/onnx_node_tests_gpu.log" || status=1
    exit $status
    ;;
bench)
    # The runs' token shard, outputs and exported models stay out of $OUT (what comes back is
    # limited): the table, its JSON and the log go there.
    work=$(mktemp -d)
    status=0
    PYTHONUNBUFFERED=1 python3 worker/benches/gpu_gpt2_124m.py --worker "$bundle/tensorfleet-worker" \
        --out "$work" "$@" 2>&1 | tee "$out/bench.log" || status=1
    cp "$work/gpu-bench.json" "$out/" 2>/dev/null || true
    exit $status
    ;;
*)
    echo "gpu_session: the mode is check or bench, not '$mode'" >&2
    exit 2
    ;;
esac
