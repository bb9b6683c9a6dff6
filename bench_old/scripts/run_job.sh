#!/usr/bin/env bash
# Set everything up and run the main job with its embedded defaults (CPU, gloo, 2 ranks,
# 256 MiB per node).  Extra arguments go to launch/run.py, e.g. --layout shared --rounds 4.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
NPROC="${NPROC:-2}"
cd "$ROOT"
exec torchrun --standalone --nproc-per-node "$NPROC" launch/run.py --device "${DEVICE:-cpu}" "$@"
