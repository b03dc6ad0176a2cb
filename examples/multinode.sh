#!/usr/bin/env bash
# elastictrain on plain hosts: run this on every node, with the same HEAD and RUN_ID.
#
#   HEAD=node0.example.com RUN_ID=exp1 NPROC=8 bash examples/multinode.sh
#
# Elastic and timeout settings, and why:
# - --nnodes=MIN:MAX: the job keeps going with MIN nodes and grows back to MAX at the next
#   rendezvous, so a lost node costs at most one checkpoint interval, not the job.
# - HEAD hosts the c10d rendezvous store: pick a stable host. If it is lost, the others exit within
#   seconds and a relaunch resumes from the last checkpoint (README, "Failure model").
# - --init-timeout is generous because hosts start minutes apart; --collective-timeout must exceed
#   the worst expected skew between ranks; --hang-timeout the slowest legitimate step.
set -euo pipefail
: "${HEAD:?set HEAD to the host that runs the rendezvous store}"
RUN_ID=${RUN_ID:-elastictrain}
PORT=${PORT:-29400}
MIN_NODES=${MIN_NODES:-1}
MAX_NODES=${MAX_NODES:-4}
# torch 2.13: a node can only join a running job with per-round rendezvous stores (README).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

ET_ARGS=(
  --checkpoint-dir "${CHECKPOINT_DIR:-./checkpoints}"
  --checkpoint-every-steps 500
  --keep-last 3
  --init-timeout 900
  --collective-timeout 600
  --hang-timeout 600
)

exec torchrun --nnodes="${MIN_NODES}:${MAX_NODES}" --nproc_per_node="${NPROC:-1}" \
  --max-restarts=10 --rdzv-backend=c10d --rdzv-endpoint="${HEAD}:${PORT}" --rdzv-id="${RUN_ID}" \
  -m elastictrain "${ET_ARGS[@]}" "$@"
