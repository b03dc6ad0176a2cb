"""elastictrain.observe.events: the JSONL event log."""

from __future__ import annotations

from elastictrain.observe.events import EventLog, read_events


def test_event_log_appends_and_tolerates_torn_line(tmp_path):
    path = str(tmp_path / "sub" / "e.jsonl")
    EventLog(path, enabled=True).emit("start", world_size=2)
    with open(path, "a") as f:
        f.write('{"event": "torn')  # a kill mid-write
    EventLog(path, enabled=True).emit("end", step=3)
    EventLog(path, enabled=False).emit("ignored")
    assert [e["event"] for e in read_events(path)] == ["start", "end"]
