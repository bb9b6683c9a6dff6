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
# tests/test_wheel.py builds a wheel offline (--no-build-isolation): the build backend must be here
if ! "$VENV/bin/python" -c "import setuptools.command.bdist_wheel" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "setuptools>=70.1"
fi
"$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
export PATH="$VENV/bin:$PATH"
