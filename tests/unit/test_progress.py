"""elastictrain.observe.progress and terminal: rank 0's progress line."""

from __future__ import annotations

import io
import logging

import torch

from elastictrain.observe.events import Event, EventLog, read_events
from elastictrain.observe.logs import setup_logging
from elastictrain.observe.progress import Progress
from elastictrain.observe.terminal import STATUS, live_terminal


def test_progress_reports_rate_eta_and_last_checkpoint(tmp_path, caplog):
    import logging

    from elastictrain.observe.progress import Progress

    path = str(tmp_path / "e.jsonl")
    progress = Progress(
        world_size=2,
        start_step=0,
        max_steps=100,
        every_s=3600,
        events=EventLog(path, enabled=True),
        enabled=True,
    )
    progress.last_checkpoint = 40
    with caplog.at_level(logging.INFO, logger="elastictrain.observe.progress"):
        assert not progress.due()  # inside the interval
        progress.report(50, torch.tensor(0.25))
    (event,) = read_events(path)
    assert (
        event["event"] == Event.PROGRESS
        and event["step"] == 50
        and event["loss"] == 0.25
        and event["steps_per_s"] > 0
    )
    assert (
        "progress 50/100 loss 0.25000" in caplog.text
        and "eta" in caplog.text
        and "last checkpoint 40 world size 2" in caplog.text
    )
    assert "local copy" not in caplog.text  # no local tier: nothing to say
    # A local copy newer than the durable checkpoint is worth a word; an older one is not.
    progress.last_local = 47
    with caplog.at_level(logging.INFO, logger="elastictrain.observe.progress"):
        progress.report(60, torch.tensor(0.25))
        progress.last_checkpoint = 60
        progress.report(70, torch.tensor(0.25))
    first, second = [
        r.getMessage()
        for r in caplog.records
        if "progress 6" in r.getMessage() or "progress 7" in r.getMessage()
    ]
    assert first.endswith("world size 2 local copy 47"), first
    assert second.endswith("world size 2"), second


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_terminal_only_on_a_tty(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert live_terminal("auto", FakeTTY()) and not live_terminal("auto", io.StringIO())
    assert live_terminal("live", io.StringIO()) and not live_terminal("plain", FakeTTY())
    monkeypatch.setenv("TERM", "dumb")
    assert not live_terminal("auto", FakeTTY())


def test_live_status_line_redraws_in_place_and_logs_print_above_it(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the line is cut to the terminal's width
    now = [0.0]
    tty = FakeTTY()
    progress = Progress(
        world_size=2,
        start_step=0,
        max_steps=100,
        every_s=10,
        events=EventLog(str(tmp_path / "e.jsonl"), enabled=True),
        enabled=True,
        restarts=1,
        live=True,
        stream=tty,
        clock=lambda: now[0],
    )
    setup_logging(0)
    try:
        progress.last_checkpoint = 40
        now[0] = 0.1
        progress.tick(5, torch.tensor(0.5))  # too soon after the last draw: nothing
        assert tty.getvalue() == ""
        now[0] = 1.0
        progress.tick(50, torch.tensor(0.25))
        line = tty.getvalue()
        assert line.startswith("\r\x1b[K") and "step 50/100" in line and "50.0%" in line
        assert "loss 0.25000" in line and "50.0 steps/s" in line and "ETA 0:00:01" in line
        assert "ckpt 40" in line and "world 2" in line and "restarts 1" in line
        # A log record is printed on its own line, then the status is drawn again below it.
        handler = logging.getLogger().handlers[-1]
        handler.stream = tty
        logging.getLogger("elastictrain.test").warning("storage is slow")
        tail = tty.getvalue()[len(line) :]
        assert tail.startswith("\r\x1b[K") and "storage is slow\n" in tail
        assert tail.endswith(line[len("\r\x1b[K") :])
        # On a terminal the periodic plain progress line is not printed (the status says it all).
        before = tty.getvalue()
        progress.report(60, torch.tensor(0.2))
        assert "progress 60/100" not in tty.getvalue()[len(before) :]
        progress.last_checkpoint = 100  # the final checkpoint landed after the last draw
    finally:
        progress.close()
        setup_logging(0)
    assert tty.getvalue().endswith("ckpt 100 | world 2 | restarts 1\n") and STATUS.stream is None
