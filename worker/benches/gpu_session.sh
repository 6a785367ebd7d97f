#!/usr/bin/env bash
# What a session lent a GPU machine runs there (the `device` tool), from the repository root:
# issue 7's checks that need a GPU, and the GPU benchmarks (GPT-2 124M, a 125M Llama, ResNet-50).
# `make gpu-bundle` builds what it needs, here, into .gpu-bundle/; each call carries that folder:
#
#   run(command="bash worker/benches/gpu_session.sh all", carry=[".gpu-bundle"], timeout_s=600)
#
# all: one call's worth (under 10 minutes, each part under its own timeout so that a hang costs
# only its part): GPT-2's tensorfleet row (and the warp attention's where that fails), then the
# checks, then GPT-2's PyTorch rows, then the Llama's and ResNet-50's rows, then GPT-2's fp16
# rows (dynamic loss scaling) in the time left.
# ab: the changes that a fusion pass (or a benchmark option) can leave out, before and after in
# one call (tensorfleet's rows only, micro-batch 64, no op profile; each variant's table under
# $OUT/ab/<model>-<variant>/): GPT-2 without residual_layer_norm, without layer_norm_grad_add
# and layer_norm_grad_half, and with its vocabulary unpadded; the Llama without swiglu, and
# without attention_shared_heads and attention_token_major; each model with everything. Kernel
# changes have no switch: their before is a bundle of the earlier commit (GPU_BUNDLE, below).
# vs: a kernel change's before and after in one call: tensorfleet's rows (no op profile) from a
# bundle of the worker alone at the earlier commit (GPU_BASE, default .gpu-bundle-base: `make
# gpu-bundle-base BASE=<commit>`, carried beside .gpu-bundle), then from this bundle, for GPT-2
# and the Llama at micro-batch 64 and ResNet-50 at 128; each table under
# $OUT/vs/<model>-<bundle>/. Arguments after the mode go to every row, after its own.
# check: the GPU-vs-CPU training tests and NCCL's one-rank communicator (tests/cuda_backend.rs),
# then the ONNX node tests on the GPU. bench: worker/benches/gpu_bench.py (arguments after the
# mode go to it, e.g. --model llama --rows tensorfleet --micro-batches 16). Logs and results go
# to $OUT, or to gpu-session/ where OUT is unset; a model's rows gather in one
# gpu-bench-<model>.json (its table in gpu-bench-<model>.txt) across bench calls on one machine.
# Should the tensor-core attention fail, TENSORFLEET_CUDA_ATTENTION=warp before the command runs
# everything on the warp kernels without a rebuild. GPU_BUNDLE=<folder> runs another bundle than
# .gpu-bundle (for a baseline: `make gpu-bundle GPU_BUNDLE=.gpu-bundle-base` on the earlier
# commit, carried beside the other, so that before and after are measured in one call on one
# machine).
set -euo pipefail
mode=${1:?"usage: gpu_session.sh all|ab|vs|check|bench [benchmark arguments]"}
shift
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bundle=${GPU_BUNDLE:-.gpu-bundle}
[[ -f $bundle/built-at ]] || { echo "gpu_session: no $bundle here; run 'make gpu-bundle' and carry it" >&2; exit 2; }
out=${OUT:-gpu-session}
mkdir -p "$out"

# CUDA 13's libraries as pip installs them beside the machine's PyTorch (cuBLASLt, NVRTC, NCCL);
# the driver's libcuda is the system's.
libs=$(python3 -c 'import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = spec.submodule_search_locations if spec else []
print(":".join(sorted({d for r in roots for d in glob.glob(os.path.join(r, "*", "lib"))})))')
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} RUST_BACKTRACE=1
# The test binaries find their sources (the known node-test failures) where they were built.
built=$(<"$bundle/built-at")
if [[ ! -e $built/worker ]]; then
    mkdir -p "$built"
    ln -sfn "$PWD/worker" "$built/worker"
fi
{ nvidia-smi || true; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; } >"$out/machine.txt" 2>&1

case $mode in
all)
    # The parts run on whatever the one before left; a part's failure is in its log. The bf16
    # parts' limits add up to 540 s (on an H200 they took about 95, 40, 66, 127 and 126 s, on an
    # H100 337 s together); the fp16 rows come last and get what is left of 580 s, under a call's
    # 10 minutes. The fallback row, only where the default attention failed, adds 110 s, and then
    # the fp16 rows may get none.
    sizes=--micro-batches=64,32,16
    others=(--steps 10 --warmup 3 --run-timeout 60)
    part() { echo "== $SECONDS s: $*" | tee -a "$out/parts.txt"; }
    rm -f /tmp/tensorfleet-gpu-bench/gpu-bench-*.json  # this call's rows only
    part bench gpt2 tensorfleet
    timeout -k 10 110 bash "$0" bench --rows tensorfleet --run-timeout 100 $sizes || true
    # The warp attention kernels' row only where the default ones failed (it takes minutes).
    if ! grep -q '"items_per_s"' /tmp/tensorfleet-gpu-bench/gpu-bench-gpt2.json 2>/dev/null; then
        part bench gpt2 tensorfleet_warp_attn
        timeout -k 10 110 bash "$0" bench --rows tensorfleet_warp_attn --run-timeout 100 $sizes || true
    fi
    part check
    timeout -k 10 60 bash "$0" check || true
    part bench gpt2 pytorch
    timeout -k 10 90 bash "$0" bench --rows pytorch_eager,pytorch_compile $sizes || true
    part bench llama
    timeout -k 10 140 bash "$0" bench --model llama --rows tensorfleet,pytorch_eager,pytorch_compile \
        "${others[@]}" $sizes || true
    part bench resnet50
    timeout -k 10 140 bash "$0" bench --model resnet50 --rows tensorfleet,pytorch_eager,pytorch_compile \
        "${others[@]}" --micro-batches=128,64 || true
    left=$((580 - SECONDS))
    if ((left > 30)); then
        part bench gpt2 fp16 "(${left} s left)"
        timeout -k 10 "$left" bash "$0" bench --rows tensorfleet_fp16,pytorch_compile_fp16,pytorch_eager_fp16 \
            --no-profile --steps 10 --warmup 3 --run-timeout 100 $sizes || true
    else
        part no time left for gpt2 fp16
    fi
    part done
    cat "$out"/gpu-bench-*.txt 2>/dev/null || true
    ;;
ab)
    # model:variant:passes left out[:more benchmark arguments]. About 30 s a row on an H200
    # (each under its own limit; their limits add up to 560 s).
    variants=(
        "gpt2:all::"
        "gpt2:no-residual-layer-norm:residual_layer_norm:"
        "gpt2:no-layer-norm-grad-fusions:layer_norm_grad_add,layer_norm_grad_half:"
        "gpt2:vocab-50257::--vocab-multiple 1"
        "llama:all::"
        "llama:no-swiglu:swiglu:"
        "llama:heads-written-out:attention_shared_heads,attention_token_major:"
    )
    for v in "${variants[@]}"; do
        IFS=: read -r model name passes extra <<<"$v"
        echo "== $SECONDS s: ab $model $name" | tee -a "$out/parts.txt"
        # This row's table alone: `bench` copies out every table it finds.
        rm -f /tmp/tensorfleet-gpu-bench/gpu-bench-*.json /tmp/tensorfleet-gpu-bench/gpu-bench-*.txt
        # shellcheck disable=SC2086 # $extra is words of arguments
        OUT="$out/ab/$model-$name" TENSORFLEET_DISABLED_PASSES=$passes timeout -k 10 80 bash "$0" bench \
            --model "$model" --rows tensorfleet --steps 10 --warmup 3 --micro-batches=64 --no-profile \
            --run-timeout 70 $extra "$@" || true
    done
    for table in "$out"/ab/*/gpu-bench-*.txt; do
        if [[ -f $table ]]; then echo "== ${table#"$out"/ab/}"; cat "$table"; fi
    done
    ;;
vs)
    # About 30 s a row on an H200 (ResNet-50's more); each under its own limit, together 540 s.
    base=${GPU_BASE:-.gpu-bundle-base}
    [[ -x $base/tensorfleet-worker ]] || {
        echo "gpu_session: no $base here; run 'make gpu-bundle-base BASE=<commit>' and carry it" >&2
        exit 2
    }
    echo "base: $(cat "$base/commit" 2>/dev/null || echo unknown); this bundle: $bundle" | tee -a "$out/parts.txt"
    for model in gpt2 llama resnet50; do
        sizes=--micro-batches=64
        [[ $model == resnet50 ]] && sizes=--micro-batches=128
        for b in "$base" "$bundle"; do
            echo "== $SECONDS s: vs $model $b" | tee -a "$out/parts.txt"
            rm -f /tmp/tensorfleet-gpu-bench/gpu-bench-*.json /tmp/tensorfleet-gpu-bench/gpu-bench-*.txt
            # The base bundle has no ResNet-50 export of its own unless make copied one in.
            export_dir=$b
            [[ -f $b/resnet50.onnx ]] || export_dir=$bundle
            OUT="$out/vs/$model-$(basename "$b")" GPU_BUNDLE=$b timeout -k 10 90 bash "$0" bench --model "$model" \
                --rows tensorfleet --steps 10 --warmup 3 $sizes --no-profile --run-timeout 80 \
                --resnet50-export "$export_dir" "$@" || true
        done
    done
    for table in "$out"/vs/*/gpu-bench-*.txt; do
        if [[ -f $table ]]; then echo "== ${table#"$out"/vs/}"; cat "$table"; fi
    done
    ;;
check)
    nodes=$(mktemp -d)
    tar xzf "$bundle/onnx-node-tests.tgz" -C "$nodes"
    export TENSORFLEET_ONNX_NODE_TESTS=$nodes/node
    status=0
    "$bundle/cuda_backend" --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$out/cuda_backend.log" || status=1
    "$bundle/onnx_node_tests" --exact onnx_backend_node_tests_on_the_gpu --include-ignored --nocapture 2>&1 \
        | tee "$out/onnx_node_tests_gpu.log" || status=1
    exit $status
    ;;
bench)
    # The runs' token shard, outputs and exported models stay out of $OUT (what comes back is
    # limited): the table, its JSON, the log and the worker's stderr go there.
    work=/tmp/tensorfleet-gpu-bench
    mkdir -p "$work"
    status=0
    PYTHONUNBUFFERED=1 python3 worker/benches/gpu_bench.py --worker "$bundle/tensorfleet-worker" \
        --resnet50-export "$bundle" --out "$work" "$@" 2>&1 | tee -a "$out/bench.log" || status=1
    cp "$work"/gpu-bench-*.json "$work"/gpu-bench-*.txt "$work/worker-stderr.log" "$out/" 2>/dev/null || true
    exit $status
    ;;
*)
    echo "gpu_session: the mode is all, ab, vs, check or bench, not '$mode'" >&2
    exit 2
    ;;
esac
