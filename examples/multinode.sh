#!/usr/bin/env bash
# elastictrain on plain hosts: run this on every node, with the same HEAD, RUN_ID and CHECKPOINT_DIR.
#
#   HEAD=node0.example.com RUN_ID=exp1 NPROC=8 CHECKPOINT_DIR=s3://bucket/runs/exp1 \
#       bash examples/multinode.sh [elastictrain flags...]
#
# It prints the torchrun command it runs: the same on every node.
#
# Elastic and timeout settings, and why:
# - CHECKPOINT_DIR must be storage every node shares (S3, an NFS path, a bucket mounted on every
#   node): after a node loss rank 0 may run on another host, and it must find the checkpoints there.
#   No folder is shared by every set of hosts, so there is no default; the job checks at every start
#   and stops with exit 2, naming the host that cannot see it, when the nodes do not share it.
# - --nnodes=MIN:MAX: the job keeps going with MIN nodes and grows back to MAX at the next
#   rendezvous, so a lost node costs at most one checkpoint interval, not the job.
# - --max-restarts counts worker failures (a lost node is one for the survivors); the default 10
#   covers ten such events per launch. A node joining is not counted.
# - HEAD hosts the c10d rendezvous store: pick a stable host. If it is lost, the others exit within
#   seconds and a relaunch resumes from the last checkpoint (README, "Failure model").
# - torch's rendezvous timings (5 s heartbeats x 3 before a node is dead, a 30 s last call for
#   stragglers) are kept: shorter ones turn a slow node into a "lost" one.
# - --init-timeout is generous because hosts start minutes apart; --collective-timeout must exceed
#   the worst expected skew between ranks; --hang-timeout the slowest legitimate step.
set -euo pipefail
: "${HEAD:?set HEAD to the host that runs the rendezvous store}"
: "${CHECKPOINT_DIR:?set CHECKPOINT_DIR to storage every node shares, e.g. s3://bucket/runs/exp1 or an NFS path}"
RUN_ID=${RUN_ID:-elastictrain}
PORT=${PORT:-29400}
MIN_NODES=${MIN_NODES:-1}
MAX_NODES=${MAX_NODES:-4}
# torch 2.13: a node can only join a running job with per-round rendezvous stores (README).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

ET_ARGS=(
  --checkpoint-dir "${CHECKPOINT_DIR}"
  --checkpoint-every-steps 500
  --keep-last 3
  --init-timeout 900
  --collective-timeout 600
  --hang-timeout 600
)

CMD=(torchrun --nnodes="${MIN_NODES}:${MAX_NODES}" --nproc_per_node="${NPROC:-1}"
  --max-restarts=10 --rdzv-backend=c10d --rdzv-endpoint="${HEAD}:${PORT}" --rdzv-id="${RUN_ID}"
  -m elastictrain "${ET_ARGS[@]}" "$@")
echo "on $(hostname): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ${CMD[*]}" >&2
exec "${CMD[@]}"
