"""Issue 5's integrity trial: SIGKILL rank 0 while it persists (tests/helpers/kill_during_persist.py)."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.kill_during_persist import run_trials

# CI runs 5 trials (about 60 s) to stay inside its time budget; docs/measurements.md's 20-trial
# figure comes from `python -m tests.helpers.kill_during_persist --trials 20 --seed 1`, or
# ELASTICTRAIN_PERSIST_KILL_TRIALS=20 here.
TRIALS = int(os.environ.get("ELASTICTRAIN_PERSIST_KILL_TRIALS", "5"))


@pytest.mark.slow
def test_kill_rank0_during_persist_never_leaves_a_bad_commit(tmp_path):
    result = run_trials(str(tmp_path), TRIALS, seed=3)
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}))
    assert result["during_persist"] == TRIALS
    assert result["committed_but_incomplete"] == 0
    assert result["resumed_from_newest_committed"] == result["kills"]
    # Uncommitted leftovers are invisible, never reported as corrupt.
    assert not result["corrupt_checkpoint_logged"]
    assert result["checkpoint_bytes"]  # commits happened between the kills
