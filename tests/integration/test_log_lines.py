"""What a person reads: at INFO the start, the resume, each durable checkpoint, progress and the
end. Local-tier copies (every few steps) and retention are DEBUG lines and events."""

from __future__ import annotations

import re

from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import run_single, toy_args


def test_info_log_shows_durable_checkpoints_and_no_local_copies_or_retention_lines(tmp_path):
    ev = str(tmp_path / "ev.jsonl")
    args = toy_args(str(tmp_path / "c"), ev, max_steps=60, every=10, step_time=0.002)
    run = run_single([*args, "--local-every-steps", "2"], str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    info = [line for line in run.stderr.splitlines() if " INFO " in line]
    assert not [line for line in info if "retention" in line or "local checkpoint" in line], info
    commits = [line for line in info if re.search(r"\] checkpoint step \d+ committed", line)]
    assert len(commits) == 6, info  # steps 10..60, one line each
    # Retention still runs and says what it deleted, on the durable commit's own line.
    assert "; deleted step 10" in commits[3], commits
    events = read_events(ev)
    assert sum(e["event"] == Event.LOCAL_CHECKPOINT for e in events) >= 10  # still recorded
    assert len(info) <= 14, "\n".join(info)
