"""The run's history beside its checkpoints: rank 0's event mirror and every rank's last words,
against a real local store and a store that fails or hangs; and `report` merging sources."""

from __future__ import annotations

import json
import threading
import time

import storage
from elastictrain.checkpoint.write import node_check as node_check
from elastictrain.observe import report
from elastictrain.observe.events import Event, EventLog, LastWords
from elastictrain.observe.history import RunHistory, merge_lines


class FlakyStore:
    """Wraps a real store; the first ``fail`` history writes raise, and ``gate`` (when set)
    holds every write until it is opened."""

    def __init__(self, store: storage.CheckpointStore, fail: int = 0) -> None:
        self.store, self.fail, self.gate = store, fail, None
        self.attempts: list[str] = []

    def write_history(self, name: str, data: bytes) -> None:
        self.attempts.append(name)
        if self.gate is not None:
            self.gate.wait()
        if self.fail > 0:
            self.fail -= 1
            raise storage.StorageUnavailableError("injected: storage down")
        self.store.write_history(name, data)


def history_lines(url: str) -> list[dict]:
    return merge_lines(d.decode() for _, d in storage.open_store(url).read_history())


def test_the_mirror_holds_every_event_once_across_failed_writes(tmp_path):
    """Two failed flushes, then one that works: every line lands exactly once, in order, and the
    retries rewrote the same segment name rather than adding new ones."""
    url = str(tmp_path / "ckpt")
    flaky = FlakyStore(storage.open_store(url), fail=2)
    history = RunHistory(lambda: flaky, rank=0, generation=7)
    log = EventLog(None, enabled=True, history=history)
    log.emit(Event.START, world_size=2)
    log.emit(Event.RESUME, step=0)  # asks for a segment: fails
    history.flush(wait_s=5)
    log.emit(Event.PROGRESS, step=10)
    log.emit(Event.CHECKPOINT, step=20)  # fails again
    history.flush(wait_s=5)
    log.emit(Event.END, step=20)  # works: everything so far, once
    history.flush(wait_s=5)
    events = history_lines(url)
    assert [e["event"] for e in events] == ["start", "resume", "progress", "checkpoint", "end"]
    assert set(flaky.attempts) == {"g7-s000000.jsonl"} and len(flaky.attempts) >= 3
    log.emit(Event.CHECKPOINT, step=40)  # the next segment gets the next name
    history.flush(wait_s=5)
    assert flaky.attempts[-1] == "g7-s000001.jsonl"
    assert [e.get("step") for e in history_lines(url)][-1] == 40


def test_a_hung_store_never_blocks_the_training_thread(tmp_path):
    """emit and flush return at once while a write hangs; an exit's bounded flush gives up."""
    flaky = FlakyStore(storage.open_store(str(tmp_path / "ckpt")))
    flaky.gate = threading.Event()  # never opened until the end: storage hangs
    history = RunHistory(lambda: flaky, rank=0, generation=1)
    log = EventLog(None, enabled=True, history=history)
    t0 = time.monotonic()
    for step in range(100):
        log.emit(Event.CHECKPOINT, step=step)  # each asks for a segment
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    history.flush(wait_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0
    flaky.gate.set()
    history.flush(wait_s=5)
    assert [e["step"] for e in history_lines(str(tmp_path / "ckpt"))] == list(range(100))


def test_last_words_of_any_rank_reach_the_location(tmp_path):
    url = str(tmp_path / "ckpt")
    store = storage.open_store(url)
    LastWords(None, 5, history=RunHistory(lambda: store, rank=5, generation=3))(
        "hang", "no progress for 5.0s"
    )
    ((name, data),) = store.read_history()
    assert name.startswith("exit-g3-r00005-")
    record = json.loads(data)
    assert record["event"] == Event.EXIT and record["rank"] == 5 and record["cause"] == "hang"


def test_merge_orders_by_time_and_drops_lines_seen_twice():
    a = '{"event": "start", "time": 1.0}\n{"event": "end", "time": 3.0}\n'
    b = '{"event": "exit", "time": 2.0, "rank": 1}\n{"event": "start", "time": 1.0}\ntorn{'
    assert [e["event"] for e in merge_lines([a, b])] == ["start", "exit", "end"]


def test_report_merges_host_logs_and_a_checkpoint_location(tmp_path, capsys):
    """Two hosts' logs, and the location: one run, each event once."""
    start = {"event": "start", "world_size": 2, "restart_count": 0, "generation": 1}
    host1 = [{**start, "time": 1.0}, {"event": "resume", "step": 0, "time": 1.5}]
    host2 = [{"event": "exit", "cause": "hang", "detail": "x", "rank": 1, "time": 2.0}]
    paths = []
    for i, events in enumerate((host1, host2)):
        paths.append(str(tmp_path / f"host{i}.jsonl"))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)
    store = storage.open_store(str(tmp_path / "ckpt"))
    store.write_history("g1-s000000.jsonl", (json.dumps(host1[1]) + "\n").encode())
    out = str(tmp_path / "r.png")
    assert report.main([*paths, str(tmp_path / "ckpt"), "-o", out]) == 0
    text = capsys.readouterr().out
    assert text.count("attempt ") == 1 and "ended: hang (rank 1: x)" in text, text
    assert report.main([str(tmp_path / "nothing-here"), "-o", out]) == 2


class Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"the node check touched storage ({name}) in a single-node job")


def test_the_node_check_never_runs_on_one_node():
    for group, world, local in ((None, 4, 1), (object(), 8, 8)):
        node_check.check_shared_storage(
            Untouchable(),
            group,
            rank=0,
            world_size=world,
            local_rank=0,
            local_world_size=local,
            generation=1,
            setting="--checkpoint-dir",
        )
