#!/usr/bin/env bash
# The GPU tier: every test marked `gpu`, on this machine's CUDA devices, then a summary.
#   bash tests/gpu/run.sh            # needs a CUDA build of torch and the test extras
# The output (and gpu-tier.log) is what a closing note quotes. Never part of CI.
set -uo pipefail
cd "$(dirname "$0")/../.."
# A GPU image may have only python3; its pytest-xdist may predate our addopts, and -n 0 needs none.
PY=${PYTHON:-$(command -v python || command -v python3)}
"$PY" - <<'PY' || exit 2
import torch
if not torch.cuda.is_available():
    raise SystemExit(f"no CUDA here (torch {torch.__version__}): the GPU tier needs a GPU and a CUDA build of torch")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} device(s): {names}")
PY
start=$(date +%s)
"$PY" -m pytest tests/gpu -m gpu -o addopts= -n 0 -v -s -rA --timeout 600 -p no:cacheprovider "$@" 2>&1 | tee gpu-tier.log
status=${PIPESTATUS[0]}
echo "== GPU tier summary ($(( $(date +%s) - start )) s, pytest exit $status) =="
grep -E "^(PASSED|FAILED|SKIPPED|ERROR) |GPU-FIGURE" gpu-tier.log | sed 's/^\(PASSED\|FAILED\|SKIPPED\|ERROR\)/  \1/'
exit "$status"
