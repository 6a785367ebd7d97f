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

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
IMAGE_PREFIX ?= tensorfleet
IMAGE_TAG ?= $(VERSION)

.PHONY: deps build demo demo-data test bench images clean

deps:
	bash .ci/deps.sh

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

# The node tests are the ONNX backend suite shipped inside the venv's onnx package.
test: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	node_tests="$$($(VENV_PYTHON) .ci/onnx_node_tests_dir.py)"; \
	TENSORFLEET_PYTHON=$(VENV_PYTHON) TENSORFLEET_ONNX_NODE_TESTS="$$node_tests" \
		$(CARGO) test --workspace --release

# Criterion benchmarks (worker/benches/): GEMM GFLOP/s against the machine's measured peak, and
# a training step of GPT-2 and SqueezeNet next to PyTorch on the CPU, measured in the same run.
# .ci/bench-deps.sh installs that peer in .venv-bench/ (torch from PyPI: about 3 GB, for this
# target only). The figures land in target/bench-summary.json for docs/PERFORMANCE.md.
bench: deps
	bash .ci/bench-deps.sh
	TENSORFLEET_BENCH_PYTHON=$(CURDIR)/.venv-bench/bin/python $(CARGO) bench -p tensorfleet-worker --bench '*'

# Needs a Docker engine; the development machines and CI have none, so this is not built there.
images:
	@docker info >/dev/null 2>&1 || { \
		echo "images: no Docker engine answers here ('docker info' failed); run 'make images' on a machine with one" >&2; \
		exit 1; }
	docker build --target operator --tag $(IMAGE_PREFIX)/operator:$(IMAGE_TAG) .
	docker build --target worker --tag $(IMAGE_PREFIX)/worker:$(IMAGE_TAG) .

# Build outputs and run outputs; the venv and the demo's tokens are rebuilt by the next make.
clean:
	$(CARGO) clean
	rm -rf .venv out examples/local/out $(DEMO_TOKENS)
