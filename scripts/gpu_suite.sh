#!/usr/bin/env bash
# On a CUDA host (e.g. the lent H200 machine): the GPU tests, the main job on CUDA in every
# layout, and both benchmarks, in one call.  Logs and JSON go to $OUT (default ./gpu-out).
#   OUT=/tmp/out STARTUP_BYTES=32GiB bash scripts/gpu_suite.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
NGPU="$($PY -c 'import torch; print(torch.cuda.device_count())')"
NPROC="${NPROC:-$NGPU}"
status=0
step() {  # name, command...
    local name="$1"; shift
    echo "=== $name" | tee -a "$OUT/summary.txt"
    if "$@" > "$OUT/$name.log" 2>&1; then echo "ok" >> "$OUT/summary.txt"
    else echo "FAILED ($?)" | tee -a "$OUT/summary.txt"; status=1; fi
    tail -n "${TAIL:-15}" "$OUT/$name.log"
}
[ "${SKIP_TESTS:-0}" = 1 ] || step gpu_tests "$PY" -m pytest -q -p no:cacheprovider tests/gpu \
    tests/test_region_pin.py
if [ "${SKIP_JOB:-0}" != 1 ]; then
    for layout in private shared replicated; do
        step "job_$layout" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
            launch/run.py --device cuda --layout "$layout" --cpu-bytes "${JOB_BYTES:-4GiB}" \
            --num-gpu-blocks 4096 --kv-bytes-per-block 256KiB --rounds 2 \
            --report-json "$OUT/job_$layout.json"
    done
fi
[ "${SKIP_TRANSFER:-0}" = 1 ] || step bench_transfer "$PY" scripts/bench_transfer.py \
    --json "$OUT/transfer.json" ${TRANSFER_ARGS:-}
[ "${SKIP_STARTUP:-0}" = 1 ] || step bench_startup "$PY" scripts/bench_startup.py \
    --nproc "$NPROC" --cpu-bytes "${STARTUP_BYTES:-32GiB}" --json "$OUT/startup.json" \
    ${STARTUP_ARGS:-}
cat "$OUT/summary.txt"
exit "$status"
