#!/usr/bin/env bash
# The GPU tier: every test marked `gpu`, on this machine's CUDA devices, then a summary.
#   bash tests/gpu/run.sh            # needs a CUDA build of torch and the test extras
# The output (and gpu-tier.log) is what a closing note quotes. Never part of CI.
set -uo pipefail
cd "$(dirname "$0")/../.."
python - <<'PY' || exit 2
import torch
if not torch.cuda.is_available():
    raise SystemExit(f"no CUDA here (torch {torch.__version__}): the GPU tier needs a GPU and a CUDA build of torch")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} device(s): {names}")
PY
start=$(date +%s)
python -m pytest tests/gpu -m gpu -n 0 -v -s -rA --timeout 600 -p no:cacheprovider "$@" 2>&1 | tee gpu-tier.log
status=${PIPESTATUS[0]}
echo "== GPU tier summary ($(( $(date +%s) - start )) s, pytest exit $status) =="
grep -E "^(PASSED|FAILED|SKIPPED|ERROR) |GPU-FIGURE" gpu-tier.log | sed 's/^\(PASSED\|FAILED\|SKIPPED\|ERROR\)/  \1/'
exit "$status"
