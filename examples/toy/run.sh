#!/usr/bin/env bash
# The default task (the DDP tutorial's ToyModel, elastictrain/toy.py) on 2 local processes, with an
# event log, then the run report. Kill workers while it runs (kill -9 <pid>, or put the torchrun
# line below under `python -m elastictrain chaos --fault kill-worker -- torchrun ...`) and the
# report shows each restart and its cause.
#
#   bash examples/toy/run.sh [elastictrain flags...]     e.g. --max-steps 3000 --task-option step_time=0.005
#
# OUT (default ./toy-run) receives checkpoints/, events.jsonl and report.png. The report needs
# matplotlib: pip install 'elastictrain[report]'.
set -euo pipefail
OUT=${OUT:-./toy-run}
# --max-restarts: how many worker failures torchrun absorbs before giving up (each resumes from the
# newest checkpoint). The runner's own timeouts keep their defaults (README, "Timeouts").
torchrun --standalone --nproc_per_node="${NPROC:-2}" --max-restarts="${MAX_RESTARTS:-3}" \
  -m elastictrain --checkpoint-dir "${OUT}/checkpoints" --event-log "${OUT}/events.jsonl" "$@"
python -m elastictrain report "${OUT}/events.jsonl" -o "${OUT}/report.png"
