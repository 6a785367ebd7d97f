#!/usr/bin/env bash
# Installs the PyTorch CPU peer of `make bench` (worker/benches/pytorch_peer.py) into .venv-bench/.
# Only benchmarks need it: torch from PyPI is about 3 GB to download (the default Linux wheel pulls
# the CUDA runtime packages too), so `make test` and `make demo` never run this.
# Run .ci/deps.sh first (it installs python3-venv). Safe to run again: with the venv up to date it
# only checks, in well under a second.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=${EPOCHREALTIME//[!0-9]/}  # microseconds

REQUIREMENTS=worker/benches/requirements-bench.txt
VENV=.venv-bench
STAMP=$VENV/.tensorfleet-requirements.sha256
PIP_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/tensorfleet/pip
# The same interpreter as .ci/deps.sh: Debian's, or TENSORFLEET_BOOTSTRAP_PYTHON.
if [[ -n ${TENSORFLEET_BOOTSTRAP_PYTHON:-} ]]; then
    BOOTSTRAP_PYTHON=$TENSORFLEET_BOOTSTRAP_PYTHON
elif [[ -x /usr/bin/python3 ]]; then
    BOOTSTRAP_PYTHON=/usr/bin/python3
else
    BOOTSTRAP_PYTHON=python3
fi

# The stamp covers the requirements and the interpreter, so either changing re-creates the venv.
want=$({ cat "$REQUIREMENTS"; "$BOOTSTRAP_PYTHON" -c 'import sys; print(sys.version)'; } \
    | sha256sum | cut -d' ' -f1)
if [[ -x $VENV/bin/python && -f $STAMP && $(<"$STAMP") == "$want" ]]; then
    venv_note="$VENV up to date"
else
    echo "bench-deps: creating $VENV from $REQUIREMENTS with $BOOTSTRAP_PYTHON (torch: about 3 GB to download)"
    rm -rf "$VENV"
    "$BOOTSTRAP_PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --cache-dir "$PIP_CACHE" \
        --only-binary=:all: --requirement "$REQUIREMENTS"
    # Fail here, not after the engine's benchmarks have run for minutes.
    "$VENV/bin/python" -c 'import numpy, torch; torch.ones(2) @ torch.ones(2)'
    # Written last, so an interrupted install is redone on the next run.
    echo "$want" >"$STAMP"
    venv_note="created $VENV (torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
fi

elapsed_ms=$(((${EPOCHREALTIME//[!0-9]/} - started) / 1000))
printf 'bench-deps: ok: %s; %d.%03ds\n' "$venv_note" $((elapsed_ms / 1000)) $((elapsed_ms % 1000))
