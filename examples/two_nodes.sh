#!/usr/bin/env bash
# Two simulated "nodes" on this machine: two torchrun agents sharing one c10d rendezvous.
# Kill one (its agent and workers) and the other carries on at world size 1; start it again and the
# job grows back to 2 at the next rendezvous.
#
#   bash examples/two_nodes.sh [elastictrain flags...]          both nodes, from this shell
#   NODE=0 bash examples/two_nodes.sh [flags...]                 only node 0 (hosts the rendezvous)
#   NODE=1 bash examples/two_nodes.sh [flags...]                 only node 1 (e.g. another terminal)
#   NPROC=2 ...           ranks per node (default 1)
#   NNODES=3 ...          torchrun's --nnodes (default 1:2): e.g. a third node, started with NODE=2,
#                         that stands by with --replace-in-place --spare-nodes 1 (docs/multinode.md)
#   RDZV_OFF_NODE=1 ...   no node hosts the rendezvous store: it runs at 127.0.0.1:$PORT off the
#                         training nodes (a store server, or etcd), so a frozen node never holds
#                         it (docs/faults.md)
#
# Checkpoints: every node must read and write the same storage. The job proves it at every start
# and stops with exit 2 naming the blind host if not: a node-local ./checkpoints would let rank 0
# land on a host without them after a node loss, and the job would start over from step 0. Both
# "nodes" here are this machine, so an absolute path on it is shared. On real hosts use
# CKPT=s3://bucket/run or a path on NFS, and examples/multinode.sh.
set -euo pipefail
PORT=${PORT:-29431}
RUN_ID=${RUN_ID:-two-nodes-demo}
CKPT=${CKPT:-${TMPDIR:-/tmp}/elastictrain-${RUN_ID}}
# torch 2.13: a node can only *join* a running job with per-round stores (README, "Elastic membership").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# Short demo timings: a lost node is noticed in about 3 s; keep torch's defaults on real clusters.
RDZV_CONF="last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"

node() {  # $1: the node (0 hosts the rendezvous store); the rest: elastictrain flags
  local cmd=(torchrun --nnodes="${NNODES:-1:2}" --nproc_per_node="${NPROC:-1}" --max-restarts="${MAX_RESTARTS:-3}"
    --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:${PORT}" --rdzv-id="${RUN_ID}"
    --rdzv-conf="${RDZV_CONF},is_host=$([[ $1 == 0 && -z ${RDZV_OFF_NODE:-} ]] && echo 1 || echo 0)"
    -m elastictrain --checkpoint-dir "${CKPT}" "${@:2}")
  echo "node $1: ${cmd[*]}" >&2
  "${cmd[@]}"
}

if [[ -n "${NODE:-}" ]]; then
  node "${NODE}" "$@"
  exit
fi
# Both at once, in no particular order: node 1's agent retries until node 0's store is up, and
# one that arrives after the first round joins at the next (the job then grows from 1 to 2).
node 0 "$@" &
HOST_PID=$!
trap 'kill "$HOST_PID" 2>/dev/null || true' EXIT
node 1 "$@"
wait "$HOST_PID"
