#!/usr/bin/env bash
# Set everything up and run the test suite (lint, types, then pytest in parallel).
# GPU tests skip where CUDA is absent.  Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
ruff check offload launch tests scripts tools
mypy offload launch
exec python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
