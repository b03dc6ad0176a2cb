"""The runner's imports run with the cyclic garbage collector paused, then frozen: a training
process's start-up (every restart, every spare) does not pay for the collector scanning torch's
300,000 import-time objects again and again (``elastictrain.__main__._import_runner``)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.launcher import job_env

# In a fresh interpreter: this one imported torch long ago. Full collections (generation 2) are
# what scan every object; counting them is the deterministic proxy for the CPU, which a unit test
# must not time.
_PROBE = """
import gc, json, sys
from elastictrain.__main__ import _import_runner
run = _import_runner()
print(json.dumps({
    "full_collections": gc.get_stats()[2]["collections"],
    "frozen": gc.get_freeze_count(),
    "enabled": gc.isenabled(),
    "runner": run.__module__,
    "dynamo": "torch._dynamo" in sys.modules,
}))
"""


def test_the_runners_imports_run_no_full_collection_and_leave_the_collector_on_with_them_frozen():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=job_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["runner"] == "elastictrain.train.runner" and seen["dynamo"], seen
    # Unpaused, importing the same modules runs several (5 here with CPython 3.11).
    assert seen["full_collections"] == 0, seen
    assert seen["frozen"] > 100_000 and seen["enabled"], seen


def test_the_training_entry_point_imports_the_runner_through_the_paused_import(
    monkeypatch, tmp_path
):
    """``python -m elastictrain`` (torchrun's workers, their restarts, the in-place spares)."""
    import elastictrain.__main__ as entry

    runs = []
    monkeypatch.setattr(entry, "_import_runner", lambda: lambda cfg, signals: runs.append(cfg) or 0)
    assert entry.main(["--checkpoint-dir", str(tmp_path), "--max-steps", "1"]) == 0
    assert [cfg.max_steps for cfg in runs] == [1]
