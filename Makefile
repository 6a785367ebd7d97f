# tensorfleet: `make demo` trains a small GPT-2 on the CPU; `make test` runs every test.
# Each target installs what it needs first (.ci/deps.sh: Debian packages and the Python venv).

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c

CARGO ?= cargo
# The venv's interpreter runs the test oracles (onnx, onnxruntime, numpy) for the Rust tests.
VENV_PYTHON := $(CURDIR)/.venv/bin/python

DEMO_CONFIG := examples/local/quickstart.yaml
DEMO_CORPUS := examples/local/data/corpus.txt
DEMO_TOKENS := examples/local/data/tokens
# The SqueezeNet and imported-ONNX demos: a drawn image set and a CNN written by Python scripts.
SQUEEZENET_CONFIG := examples/local/squeezenet.yaml
ONNX_CONFIG := examples/local/custom-onnx.yaml
DEMO_SHAPES := examples/local/data/shapes
DEMO_CNN := examples/local/data/cnn.onnx

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
IMAGE_PREFIX ?= tensorfleet
IMAGE_TAG ?= $(VERSION)

.PHONY: deps k8s crds build demo demo-data demo-llama demo-squeezenet demo-onnx demo-shapes test e2e e2e-cluster demo-cluster demo-cluster-down bench bench-load bench-gpu test-data gpu-bundle gpu-bundle-base images fuzz clean

deps:
	bash .ci/deps.sh

# The control plane and helm, built from their Go module sources and cached by version under
# ~/.cache/tensorfleet/k8s (e2e/control-plane/README.md); a warm cache makes this instant.
k8s:
	bash e2e/control-plane/build.sh >/dev/null

# The CRD is generated from operator/src/crd.rs; the chart ships the same file (crd::CRD_FILES,
# whose unit test in `make test` fails when the committed files are out of date).
CRD_FILE := crds/trainingjobs.tensorfleet.dev.yaml
CHART_CRD := charts/tensorfleet/crds/trainingjobs.tensorfleet.dev.yaml

crds:
	$(CARGO) run -q --release -p tensorfleet-operator --bin crdgen > $(CRD_FILE)
	mkdir -p $(dir $(CHART_CRD)) && cp $(CRD_FILE) $(CHART_CRD)

build: deps
	$(CARGO) build --workspace --release

# The worker prints where metrics.jsonl, the checkpoints and model.onnx went. The demo always
# trains from the start (a plain `train` would resume from the last run's checkpoints).
demo: deps demo-data
	$(CARGO) run --release -p tensorfleet-worker -- train --config $(DEMO_CONFIG) --set checkpoint.resume=never

# Tokenizes the demo corpus once, when $(DEMO_TOKENS) does not exist; delete it to redo.
demo-data: $(DEMO_TOKENS)

$(DEMO_TOKENS):
	$(CARGO) run --release -p tensorfleet-worker -- prepare-data \
		--input $(DEMO_CORPUS) --output $(DEMO_TOKENS) --val-fraction 0.1

# The builtin Llama on the same token shards as the quickstart.
demo-llama: deps demo-data
	$(CARGO) run --release -p tensorfleet-worker -- train --config examples/local/llama.yaml --set checkpoint.resume=never

# SqueezeNet 1.1 (builtin) on the shapes set; docs/EXAMPLES.md says what to expect.
demo-squeezenet: deps demo-shapes
	$(CARGO) run --release -p tensorfleet-worker -- train --config $(SQUEEZENET_CONFIG) --set checkpoint.resume=never

# An imported ONNX model (no loss in it; the config attaches one) on the same set.
demo-onnx: deps demo-shapes $(DEMO_CNN)
	$(CARGO) run --release -p tensorfleet-worker -- train --config $(ONNX_CONFIG) --set checkpoint.resume=never

# Draws the shapes set once (sample shards, train/ and val/), when $(DEMO_SHAPES) does not
# exist; delete it to redo. The venv comes from deps (numpy, onnx).
demo-shapes: $(DEMO_SHAPES)

$(DEMO_SHAPES):
	$(VENV_PYTHON) examples/local/data/make_shapes.py --output $(DEMO_SHAPES)

$(DEMO_CNN):
	$(VENV_PYTHON) examples/local/data/make_cnn.py --output $(DEMO_CNN)

# Every check, stage by stage: deps, the control plane's Go builds, rustfmt, clippy, helm lint,
# every cargo test (the operator's against a control plane started for the run, the ONNX node
# tests, the GPU tests where there are GPUs), then e2e. .ci/test.sh prints each stage's time at
# the end.
test:
	CARGO=$(CARGO) MAKE=$(MAKE) bash .ci/test.sh

# The end-to-end scenarios (e2e/scenarios/) on the local cluster (e2e/cluster/): real nodes on
# this host (e2e/nodes/: kubelets, containerd, CNI, kube-proxy, CoreDNS, local-path claims)
# running the images `make images` built, and the operator installed with helm from its image,
# all started here (as root) and stopped at the end, the host checked to be as found. When a
# scenario fails, the cluster's logs stay in its directory, which is printed. Each stage's and
# each scenario's time is printed (e2e/run.sh).
e2e: deps images
	$(MAKE) --no-print-directory e2e-cluster

# The same without building the images first (.ci/test.sh builds them beside the cargo tests).
e2e-cluster: deps
	CARGO=$(CARGO) bash e2e/run.sh

# A fuzzing campaign (worker/tests/fuzz.rs) over every reader of inputs (token and sample
# shards, checkpoint manifests, safetensors, ONNX models, configurations, and prepare-data's
# JSON Lines, Parquet, tokenizer.json and images) and the training graph's build from
# structurally mutated exports (transformers and a CNN): FUZZ_SECONDS per
# target from a fresh seed, inputs that fail saved under target/fuzz-overflow/fuzz/. Built
# with integer overflow checks (in its own target directory, the release profile otherwise),
# so that arithmetic a hostile size wraps around panics instead of passing. `make test` runs
# a short fixed-seed round of the same targets in the plain release build.
FUZZ_SECONDS ?= 300
fuzz:
	CARGO_TARGET_DIR=target/fuzz-overflow CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true \
		TENSORFLEET_FUZZ_SECONDS=$(FUZZ_SECONDS) $(CARGO) test --release -p tensorfleet-worker --test fuzz -- --test-threads 1 --nocapture

# The local cluster left running with the CPU quickstart training on it, for a person to
# look at with kubectl (the command to use is printed); `make demo-cluster-down` stops it.
DEMO_CLUSTER := /tmp/tensorfleet-demo-cluster
demo-cluster: deps images
	bash e2e/cluster/demo.sh $(DEMO_CLUSTER)

demo-cluster-down:
	bash e2e/cluster/down.sh $(DEMO_CLUSTER)

# Benchmarks (worker/benches/): GEMM GFLOP/s against the machine's measured peak,
# a training step of GPT-2 and SqueezeNet next to PyTorch on the CPU, checkpoint and
# data-loader throughput next to the disk's own rate and NumPy's memmap loader, and (comm.rs,
# under mpirun) all-reduce bandwidth next to raw MPI_Allreduce in C with the step time of two
# data-parallel ranks next to one process, each peer measured in the same run.
# .ci/bench-deps.sh installs the Python peers in .venv-bench/ (torch from PyPI: about 3 GB, and
# numpy; for this target only). The figures land in target/bench-summary.json for
# docs/PERFORMANCE.md.
#
# The operator's bench (operator/benches/reconcile.rs): 100 TrainingJobs × 8 workers against a
# control plane started here, next to Kubeflow's MPI Operator built from its Go module source
# (e2e/mpi-operator/build.sh) on the same API server; figures in target/bench-operator.json.
bench: deps k8s
	bash .ci/bench-deps.sh
	TENSORFLEET_BENCH_PYTHON=$(CURDIR)/.venv-bench/bin/python $(CARGO) bench -p tensorfleet-worker --bench '*'
	mpi="$$(bash e2e/mpi-operator/build.sh | tail -n 1)"; \
	cluster="$$(mktemp -d /tmp/tensorfleet-bench-cluster.XXXXXX)"; \
	trap 'bash e2e/control-plane/down.sh "$$cluster"' EXIT; \
	TENSORFLEET_K8S_BIN="$$(bash e2e/control-plane/build.sh | tail -n 1)" bash e2e/control-plane/up.sh "$$cluster" >/dev/null; \
	TENSORFLEET_TEST_KUBECONFIG="$$cluster/kubeconfig" TENSORFLEET_MPI_OPERATOR_DIR="$$mpi" \
		$(CARGO) bench -p tensorfleet-operator --bench reconcile
	$(MAKE) --no-print-directory bench-load

# Scenario 9 of the end-to-end tests (e2e/scenarios/benches/load.rs): 50 jobs submitted at once
# on the local cluster (as root, like make e2e), next to the MPI Operator given 50 MPIJobs on the
# same cluster; figures in target/bench-e2e-load.json.
bench-load: deps k8s
	$(CARGO) build --workspace --release
	mpi="$$(bash e2e/mpi-operator/build.sh | tail -n 1)"; \
	cluster="$$(mktemp -d /tmp/tensorfleet-load.XXXXXX)"; \
	trap 'bash e2e/cluster/down.sh "$$cluster" && rm -rf "$$cluster"' EXIT; \
	TENSORFLEET_K8S_BIN="$$(bash e2e/control-plane/build.sh | tail -n 1)" bash e2e/cluster/up.sh "$$cluster"; \
	TENSORFLEET_E2E_CLUSTER="$$cluster" TENSORFLEET_MPI_OPERATOR_DIR="$$mpi" \
		$(CARGO) bench -p tensorfleet-e2e --bench load

# The fixtures of the tests against PyTorch and Hugging Face's libraries (worker/tests/data/*/,
# each written by the export.py beside it): models exported from PyTorch and transformers
# (random init, tiny configs) with PyTorch's reference losses, tokenizers with the ids the
# `tokenizers` library gives a corpus, and a tiny ImageFolder with torchvision's tensors of it.
# The files are committed, so `make test` needs none of those libraries; this target writes
# them again.
test-data:
	bash .ci/bench-deps.sh
	.venv-bench/bin/pip install --quiet --requirement worker/tests/data/requirements-export.txt
	.venv-bench/bin/pip install --quiet --no-deps torchvision==0.29.2
	for f in worker/tests/data/*/export.py; do .venv-bench/bin/python "$$f" || exit 1; done

# Training throughput on this machine's GPU (GPT-2 124M, a 125M Llama, ResNet-50), next to
# PyTorch eager and torch.compile in the same run (worker/benches/gpu_bench.py; results in
# target/gpu-bench/gpu-bench-<model>.json). Needs a GPU, nvidia-smi and a CUDA build of torch:
# BENCH_GPU_PYTHON names its interpreter (default: .venv-bench's, whose PyPI torch carries the
# CUDA runtime). Not part of `make bench`, which runs on the development machines, and they
# have no GPU.
BENCH_GPU_PYTHON ?= $(CURDIR)/.venv-bench/bin/python
bench-gpu: deps
	bash .ci/bench-deps.sh
	$(CARGO) build --release -p tensorfleet-worker
	.venv-bench/bin/python worker/benches/export_resnet50.py --out-dir target/gpu-bench
	for model in gpt2 llama resnet50; do \
		$(BENCH_GPU_PYTHON) worker/benches/gpu_bench.py --model $$model --resnet50-export target/gpu-bench \
			--worker target/release/tensorfleet-worker --out target/gpu-bench || exit 1; \
	done

# What a session lent a GPU machine (the `device` tool) carries there, for
# worker/benches/gpu_session.sh to run: the worker and the GPU tests built as single processes
# (that machine has CUDA and no MPI), stripped, with the ONNX node tests' data, the GPU
# benchmark's ResNet-50 graph (exported with .venv-bench's torch and onnx, which
# .ci/bench-deps.sh installs: about 3 GB the first time) and the path they were built at (test
# binaries find their sources by it).
GPU_BUNDLE := .gpu-bundle
gpu-bundle: deps
	$(CARGO) build --release -p tensorfleet-worker --no-default-features --features cli --target-dir target/solo
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)
	strip -o $(GPU_BUNDLE)/tensorfleet-worker target/solo/release/tensorfleet-worker
	$(CARGO) test --release -p tensorfleet-worker --no-default-features --features cli --target-dir target/solo \
		--test cuda_backend --test onnx_node_tests --no-run --message-format=json \
		| $(CURDIR)/.venv/bin/python -c 'import json, sys; [print(m["target"]["name"], m["executable"]) for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]]' \
		| while read -r name exe; do strip -o $(GPU_BUNDLE)/$$name "$$exe"; done
	bash .ci/bench-deps.sh
	.venv-bench/bin/python worker/benches/export_resnet50.py --out-dir $(GPU_BUNDLE)
	tar czf $(GPU_BUNDLE)/onnx-node-tests.tgz -C "$$(dirname "$$(.venv/bin/python .ci/onnx_node_tests_dir.py)")" node
	echo "$(CURDIR)" > $(GPU_BUNDLE)/built-at
	du -sh $(GPU_BUNDLE)

# The worker alone, built at an earlier commit (BASE, the commit before HEAD unless given), for
# a kernel change's before and after in one call: carried beside .gpu-bundle and run by
# `gpu_session.sh vs`. About 14 MB, where a whole bundle (with the GPU tests and the node tests'
# data) is about 30 and a call carries 64 MiB; it takes the ResNet-50 export from $(GPU_BUNDLE)
# when that is built. Built in a worktree of BASE under target/, into its own target folder.
GPU_BUNDLE_BASE := .gpu-bundle-base
BASE ?= HEAD~1
gpu-bundle-base:
	rm -rf target/gpu-base-src && git worktree prune
	git worktree add --detach target/gpu-base-src "$(BASE)"
	cd target/gpu-base-src && $(CARGO) build --release -p tensorfleet-worker --no-default-features --features cli \
		--target-dir $(CURDIR)/target/solo-base
	rm -rf $(GPU_BUNDLE_BASE) && mkdir -p $(GPU_BUNDLE_BASE)
	strip -o $(GPU_BUNDLE_BASE)/tensorfleet-worker target/solo-base/release/tensorfleet-worker
	git -C target/gpu-base-src rev-parse HEAD > $(GPU_BUNDLE_BASE)/commit
	git worktree remove --force target/gpu-base-src
	cp $(GPU_BUNDLE)/resnet50.onnx $(GPU_BUNDLE)/resnet50.weights.json $(GPU_BUNDLE_BASE)/ 2>/dev/null || true
	echo "$(CURDIR)" > $(GPU_BUNDLE_BASE)/built-at
	du -sh $(GPU_BUNDLE_BASE)

# Both images from the Dockerfile, as archives under target/images/: with Docker where an engine
# answers, else with buildah on local bases (e2e/images/build.sh says how; needs root here).
images: deps
	IMAGE_PREFIX=$(IMAGE_PREFIX) IMAGE_TAG=$(IMAGE_TAG) bash e2e/images/build.sh

# Build outputs and run outputs; the venv and the demos' data are rebuilt by the next make.
clean:
	$(CARGO) clean
	rm -rf .venv out examples/local/out examples/local/out-llama $(DEMO_TOKENS) $(DEMO_SHAPES) $(DEMO_CNN)
