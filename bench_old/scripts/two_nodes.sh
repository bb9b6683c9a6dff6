#!/usr/bin/env bash
# The main job across two nodes.  On one host (default) it starts two torchrun "nodes" with
# distinct OFFLOAD_NODE_ID values; on real hosts run the same torchrun line on each with
# NODE_RANK=0/1 and MASTER_ADDR set to the first host.  Extra arguments go to launch/run.py.
# NPROC ranks per node, or NPROC0 / NPROC1 for unequal nodes (e.g. 3 + 1).  Where python3 already
# imports torch and offload (a cluster's own environment, PYTHONPATH), that environment is used
# as it is; otherwise the project's venv is set up first (scripts/setup_env.sh).  On one host with
# several GPUs, GPUS0 / GPUS1 give each simulated node its own (CUDA_VISIBLE_DEVICES), e.g.
#   GPUS0=0 GPUS1=1 NPROC=1 DEVICE=cuda bash scripts/two_nodes.sh --tp 2 --cpu-bytes 8GiB
#   NPROC=2 bash scripts/two_nodes.sh --tp 2 --pp 2 --layout shared --cpu-bytes 64MiB
#   NPROC0=3 NPROC1=1 bash scripts/two_nodes.sh --tp 4 --layout shared --cpu-bytes 64MiB
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! python3 -c "import torch, offload" 2>/dev/null; then
    source "$ROOT/scripts/setup_env.sh"
fi
cd "$ROOT"
NPROC="${NPROC:-2}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')}"
launch() {  # $1 = node rank
    local nproc_var="NPROC$1" gpus_var="GPUS$1"
    if [ -n "${!gpus_var:-}" ]; then export CUDA_VISIBLE_DEVICES="${!gpus_var}"; fi
    OFFLOAD_NODE_ID="${OFFLOAD_NODE_PREFIX:-node}$1" python3 -m torch.distributed.run --nnodes 2 --node-rank "$1" \
        --nproc-per-node "${!nproc_var:-$NPROC}" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
        launch/run.py --device "${DEVICE:-cpu}" "${@:2}"
}
if [ -n "${NODE_RANK:-}" ]; then  # real hosts: this host is one node
    launch "$NODE_RANK" "$@"
    exit
fi
launch 1 "$@" > /tmp/offload-node1.$$.log 2>&1 &
peer=$!
status=0
launch 0 "$@" || status=$?
wait "$peer" || status=$?
sed 's/^/[node1] /' /tmp/offload-node1.$$.log >&2
rm -f /tmp/offload-node1.$$.log
exit "$status"
