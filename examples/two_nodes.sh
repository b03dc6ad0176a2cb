#!/usr/bin/env bash
# Two simulated "nodes" on this machine: two torchrun agents sharing one c10d rendezvous.
# Kill one (with its workers) and the other carries on at world size 1; start it again and the
# job grows back to 2 at the next rendezvous.
#
#   bash examples/two_nodes.sh [elastictrain flags...]     e.g. --max-steps 5000 --task-option step_time=0.01
#
# On real hosts use the same flags with --rdzv-endpoint=<stable host>:29400 and drop is_host.
set -euo pipefail
PORT=${PORT:-29431}
RUN_ID=${RUN_ID:-two-nodes-demo}
# torch 2.13: a node can only *join* a running job with per-round stores (README, "Elastic membership").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
RDZV_CONF="last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"

node() {  # $1: is_host (1 for the node that hosts the rendezvous store)
  torchrun --nnodes=1:2 --nproc_per_node=1 --max-restarts=3 \
    --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:${PORT}" --rdzv-id="${RUN_ID}" \
    --rdzv-conf="${RDZV_CONF},is_host=$1" \
    -m elastictrain --checkpoint-dir "${CKPT:-./checkpoints-two-nodes}" "${@:2}"
}

node 1 "$@" &
HOST_PID=$!
trap 'kill "$HOST_PID" 2>/dev/null || true' EXIT
sleep 1
node 0 "$@"
wait "$HOST_PID"
