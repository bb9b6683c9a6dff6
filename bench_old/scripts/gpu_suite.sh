#!/usr/bin/env bash
# On a CUDA host, in one call: the GPU tests (in parallel, they share the GPU), then the
# benchmarks one after another on a quiet machine -- engine-shaped transfers, completion latency
# and node start-up -- and optionally the main job on CUDA in every layout.  Every step has a time
# limit so the whole call fits a time-limited machine.  Logs and JSON go to $LOGS, and after every
# step $OUT gets them as one archive (gpu_suite.tgz) plus summary.txt: two files, which a remote
# runner that brings back only a few files keeps, and a call cut short keeps the finished steps'.
#   OUT=/tmp/out STARTUP_BYTES=16GiB bash scripts/gpu_suite.sh
# Knobs: SKIP_{TESTS,ENGINE,TIER,COMPLETION,STARTUP}=1, RUN_JOBS=1, RUN_RELOAD=1, TEST_WORKERS,
# *_LIMIT (seconds), wheels in .whl/ (installed to a temporary folder first),
# ENGINE_ARGS / TIER_ARGS (extra arguments, e.g. TIER_ARGS="--barrier spin").
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-out}"
LOGS="${LOGS:-$(mktemp -d /tmp/gpu-suite.XXXXXX)}"
mkdir -p "$OUT" "$LOGS"
PY="${PYTHON:-python3}"
WHEELS=""
if ls "$ROOT"/.whl/*.whl > /dev/null 2>&1; then  # carried wheels (the machine has no network)
    WHEELS="$(mktemp -d /tmp/gpu-suite-wheels.XXXXXX)"
    "$PY" -m pip install -q --no-index --no-deps --target "$WHEELS" "$ROOT"/.whl/*.whl
fi
export PYTHONPATH="$ROOT${WHEELS:+:$WHEELS}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Cached bytecode, as an installed package has: a host that sets PYTHONDONTWRITEBYTECODE (the
# lent VMs do) compiles every lazily imported module from source in every process, seconds that
# land in the copy kernel's JIT and in start-up figures (docs/BENCHMARKS.md, "Set-up that leaves
# the engine alone").
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/offload-pycache}"
NGPU="$($PY -c 'import torch; print(torch.cuda.device_count())')"
NPROC="${NPROC:-2}"
status=0
step() {  # name, limit in seconds, command...
    local name="$1" limit="$2"; shift 2
    local began=$SECONDS
    if timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; then result="ok"
    else result="FAILED ($?)"; status=1; fi
    echo "=== $name: $result in $((SECONDS - began)) s" | tee -a "$OUT/summary.txt"
    tail -n "${TAIL:-12}" "$LOGS/$name.log"
    tar czf "$OUT/gpu_suite.tgz" -C "$LOGS" .
}
echo "GPUs: $NGPU" > "$OUT/summary.txt"
[ "${SKIP_TESTS:-0}" = 1 ] || step gpu_tests "${TESTS_LIMIT:-240}" "$PY" -m pytest -q \
    -p no:cacheprovider -n "${TEST_WORKERS:-6}" tests/gpu tests/test_region_pin.py
[ "${SKIP_ENGINE:-0}" = 1 ] || step bench_engine "${ENGINE_LIMIT:-120}" "$PY" \
    scripts/bench_engine.py --reps "${ENGINE_REPS:-5}" --backend hybrid,triton \
    --json "$LOGS/engine.json" ${ENGINE_ARGS:-}
[ "${SKIP_TIER:-0}" = 1 ] || step bench_tier "${TIER_LIMIT:-90}" "$PY" scripts/bench_tier.py \
    --ranks "${TIER_RANKS:-$NGPU}" --reps "${ENGINE_REPS:-5}" --json "$LOGS/tier.json" ${TIER_ARGS:-}
[ "${SKIP_COMPLETION:-0}" = 1 ] || step bench_completion "${COMPLETION_LIMIT:-60}" "$PY" \
    scripts/bench_completion.py --device cuda --ranks "${COMPLETION_RANKS:-2,4}" \
    --jobs "${COMPLETION_JOBS:-300}" --json "$LOGS/completion.json"
[ "${SKIP_STARTUP:-0}" = 1 ] || step bench_startup "${STARTUP_LIMIT:-150}" "$PY" \
    scripts/bench_startup.py --nproc "$NPROC" --cpu-bytes "${STARTUP_BYTES:-16GiB}" \
    --variants "${STARTUP_VARIANTS:-floor,ours}" --json "$LOGS/startup.json" ${STARTUP_ARGS:-}
if [ "${RUN_JOBS:-0}" = 1 ]; then
    for layout in private shared replicated; do
        step "job_$layout" "${JOB_LIMIT:-120}" "$PY" -m torch.distributed.run --standalone \
            --nproc-per-node "$NPROC" launch/run.py --device cuda --layout "$layout" \
            --cpu-bytes "${JOB_BYTES:-4GiB}" --num-gpu-blocks 4096 --kv-bytes-per-block 256KiB \
            --rounds 2 --report-json "$LOGS/job_$layout.json"
    done
fi
if [ "${RUN_RELOAD:-0}" = 1 ]; then  # a real model's prefix, token- and byte-exact
    for layout in private shared replicated; do
        step "reload_$layout" "${RELOAD_LIMIT:-180}" "$PY" -m torch.distributed.run \
            --standalone --nproc-per-node "$NPROC" launch/prefix_reload.py --device cuda \
            --layout "$layout" ${RELOAD_ARGS:-}
    done
fi
cat "$OUT/summary.txt"
exit "$status"
