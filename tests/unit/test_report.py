"""elastictrain.observe.report and timeline: a run's life drawn from its events."""

from __future__ import annotations

import json

from elastictrain.checkpoint.api import Tier
from elastictrain.observe import report, timeline
from elastictrain.observe.events import Cause, Event
from elastictrain.observe.timeline import Outcome


def ev(event: str, t: float, **fields) -> dict:
    return {"event": event, "time": t, **fields}


def attempt(t: float, world: int, restart: int, resumed: int) -> list[dict]:
    return [
        ev(
            Event.START,
            t,
            world_size=world,
            restart_count=restart,
            generation=int(t),
            max_steps=100,
        ),
        ev(Event.RESUME, t + 1, step=resumed, fresh=resumed == 0, world_size=world),
        ev(Event.FIRST_STEP, t + 2, step=resumed + 1),
    ]


def write_log(tmp_path, events, name: str = "events.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


def test_timeline_names_each_restart_cause():
    events = [
        *attempt(0, 2, 0, 0),
        ev(Event.PROGRESS, 3, step=10, loss=1.0),
        ev(Event.CHECKPOINT, 4, step=20, blocked_s=0.01, persist_s=0.1, reason="steps"),
        # attempt 0 ends without a word: a kill
        *attempt(10, 2, 1, 20),
        # rank 0 was SIGSTOPped: rank 1's watchdog saw the hang; rank 0 never speaks again
        ev(Event.EXIT, 14, cause=Cause.HANG, detail="no progress for 5.0s", rank=1),
        *attempt(20, 2, 2, 20),
        ev(Event.PREEMPTED, 22, step=30, signal="SIGTERM"),
        *attempt(30, 2, 0, 30),
        ev(Event.EXIT, 33, cause="DistBackendError", detail="Connection closed by peer"),
        ev(Event.EXIT, 33.5, cause="DistBackendError", detail="Connection reset", rank=1),
        *attempt(40, 1, 1, 30),  # came back smaller: a node was lost
        ev(Event.PROGRESS, 42, step=60, loss=0.5),
        ev(Event.END, 45, step=100),
    ]
    tl = timeline.build_timeline(events)
    outcomes = [a.outcome for a in tl.attempts]
    assert outcomes == [
        Outcome.KILL,
        Outcome.HANG,
        Outcome.PREEMPTION,
        Outcome.MEMBERSHIP,
        Outcome.FINISHED,
    ]
    assert "world size 2 -> 1" in tl.attempts[3].detail
    assert tl.attempts[0].checkpoints[0]["step"] == 20
    assert tl.attempts[4].losses == [(60, 0.5)] and tl.attempts[4].last_step == 100
    # A peer's hang explains the other ranks' errors in the same attempt, in either order.
    both = [*attempt(0, 2, 0, 0), ev(Event.EXIT, 3, cause="DistBackendError", detail="reset")]
    both.append(ev(Event.EXIT, 4, cause=Cause.HANG, detail="no progress", rank=1))
    assert timeline.build_timeline(both).attempts[0].outcome == Outcome.HANG
    text = timeline.summary(tl)
    assert text.count("\n") == 4 and "ended: hang (rank 1: no progress for 5.0s)" in text
    # How each membership epoch began: torchrun's restart count, the world size.
    assert [a.began for a in tl.attempts] == [
        "fresh start",
        "restart through torchrun",
        "restart through torchrun",
        "relaunch",
        "shrunk 2 -> 1",
    ]
    assert "attempt 4 (shrunk 2 -> 1) at +40.0s" in text, text


def test_a_kill_names_the_silent_rank_and_the_gist_of_what_its_peer_saw():
    gloo = (
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:28848: Connection reset by peer. This is typically caused by a remote worker"
    )
    start = ev(Event.START, 0, world_size=4, local_world_size=2, restart_count=0, generation=1)
    events = [start, ev(Event.RESUME, 1, step=0, fresh=True), ev(Event.PROGRESS, 2, step=10)]
    events.append(ev(Event.EXIT, 3, cause="RuntimeError", detail=gloo, rank=1))
    # A restart killed during its own startup: it never resumed, so it trained no steps.
    events.append(
        ev(Event.START, 5, world_size=4, local_world_size=2, restart_count=1, generation=2)
    )
    tl = timeline.build_timeline(events)
    (first, second) = tl.attempts
    # Only ranks 0 and 1 are on rank 0's node: rank 0 is the silent one, ranks 2-3 are not guessed.
    assert first.outcome == Outcome.KILL
    assert first.detail == (
        "rank 0 died without a word; rank 1: Read error [127.0.0.1]:28848: Connection reset by peer"
    )
    assert not second.resumed and second.resumed_step == 10  # drawn where the run had got to
    text = timeline.summary(tl)
    assert "steps 0->10" in text and "ended before resuming" in text and "steps 10->" not in text


def test_timeline_of_a_run_still_going_says_so():
    tl = timeline.build_timeline([*attempt(0, 2, 0, 0), ev(Event.PROGRESS, 5, step=10, loss=1.0)])
    assert tl.attempts[0].outcome == "running or killed" and tl.attempts[0].last_step == 10


def test_timeline_counts_fp16_overflow_skips_and_keeps_the_eval_curve(tmp_path, capsys):
    events = [
        *attempt(0, 2, 0, 0),
        ev(Event.PROGRESS, 2, step=10, loss=1.0, overflow_skips=3),
        ev(Event.EVAL, 3, step=10, metrics={"acc": 0.5}),
        ev(Event.PROGRESS, 4, step=20, loss=0.5, overflow_skips=1),
        ev(Event.EVAL, 5, step=20, metrics={"acc": 0.75}),
        ev(Event.END, 6, step=20),
    ]
    tl = timeline.build_timeline(events)
    assert tl.attempts[0].overflow_skips == 4
    assert tl.attempts[0].evals == [(10, {"acc": 0.5}), (20, {"acc": 0.75})]
    text = timeline.summary(tl)
    assert "fp16 overflow skips 4" in text and "eval at 20: acc 0.75" in text, text
    assert report.main([write_log(tmp_path, events), "-o", str(tmp_path / "r.svg")]) == 0
    assert "Task.evaluate" in (tmp_path / "r.svg").read_text()  # the eval panel is drawn
    assert "effective training time" in capsys.readouterr().out  # the goodput line


def test_report_cli_errors_name_the_fix(tmp_path, capsys, monkeypatch):
    path = write_log(tmp_path, [*attempt(0, 2, 0, 0), ev(Event.END, 5, step=100)])
    assert report.main([path, "-o", str(tmp_path / "r.jpg")]) == 2
    assert "use a .png" in capsys.readouterr().err
    assert report.main([str(tmp_path / "missing.jsonl"), "-o", "r.png"]) == 2
    assert "--event-log" in capsys.readouterr().err
    empty = write_log(tmp_path, [ev(Event.PROGRESS, 1, step=1, loss=1.0)], "no-start.jsonl")
    assert report.main([empty, "-o", str(tmp_path / "r.png")]) == 2
    assert "no 'start' event" in capsys.readouterr().err
    # matplotlib missing: the fix is named, and the text summary is still printed.
    monkeypatch.setattr(report.importlib.util, "find_spec", lambda name: None)
    assert report.main([path, "-o", str(tmp_path / "r.png")]) == 2
    out = capsys.readouterr()
    assert "pip install 'elastictrain[report]'" in out.err and "ended: finished" in out.out
    assert not (tmp_path / "r.png").exists()


def test_report_renders_svg_from_a_synthetic_log(tmp_path):
    path = write_log(
        tmp_path, [*attempt(0, 2, 0, 0), *attempt(10, 1, 1, 0), ev(Event.END, 15, step=100)]
    )
    assert report.main([path, "-o", str(tmp_path / "r.svg")]) == 0
    assert (tmp_path / "r.svg").read_text().lstrip().startswith("<?xml")


def test_a_silent_peer_is_the_attempt_s_cause_and_names_the_rank_and_host():
    silent = "no heartbeat from rank 1 on host node7 for 16.0s"
    events = [
        *attempt(0, 2, 0, 0),
        ev(Event.EXIT, 5, cause="DistBackendError", detail="Connection reset", rank=2),
        ev(Event.EXIT, 5.5, cause=Cause.PEER_SILENT, detail=silent, rank=0),
        ev(Event.EXIT, 6, cause="DistBackendError", detail="Connection reset", rank=3),
        *attempt(10, 2, 1, 0),  # the same size: the silent node came back
        ev(Event.EXIT, 15, cause=Cause.PEER_SILENT, detail=silent, rank=0),
        *attempt(20, 1, 2, 0),  # smaller: it was dropped
        ev(Event.END, 25, step=100),
    ]
    first, second, _ = timeline.build_timeline(events).attempts
    assert first.outcome == Outcome.SILENT and first.detail == f"rank 0: {silent}"
    assert second.outcome == Outcome.MEMBERSHIP and silent in second.detail


def test_a_resume_from_the_fast_tier_says_which_nodes_served_which_ranks():
    events = [*attempt(0, 4, 0, 0), ev(Event.PROGRESS, 3, step=150, loss=1.0)]
    events += [
        ev(Event.START, 10, world_size=2, restart_count=1, generation=10, max_steps=400),
        ev(
            Event.RESUME,
            11,
            step=150,
            fresh=False,
            world_size=2,
            tier=Tier.FAST,
            durable_step=100,
            steps_saved=50,
            peer_bytes=0,
            served_by={"0": [0, 1, 2, 3]},
        ),  # fmt: skip
        ev(Event.FIRST_STEP, 12, step=151),
    ]
    text = timeline.summary(timeline.build_timeline(events))
    assert "(from the fast tier: ranks 0-3 by rank 0's node; 0 bytes from other nodes, 50 steps " \
        "past the durable one)" in text, text  # fmt: skip


def test_an_in_place_recovery_is_down_from_the_epochs_leaving_and_keeps_the_steps_it_trained():
    """The picture shaded an in-place recovery from the epoch's last periodic event to the next
    first step: a 0.6 s stall drawn as 4.5 s, and the steps trained since that event looked
    lost. The epoch's ``leaving`` transition says when it ended and what it held; the next
    epoch's first transitions (written once its log exists) do not extend it.
    (Seen failing before: the attempt ended at 9.2 s at step 10.)"""
    events = [
        *attempt(0.0, 4, 0, 0),
        ev(Event.PROGRESS, 5.0, step=10, loss=1.0),
        ev(Event.EPOCH_STATE, 9.0, state="leaving", previous="training", step=14, reason="x"),
        ev(Event.EPOCH_STATE, 9.1, state="gathering", previous="leaving", reason="counted back"),
        ev(Event.EPOCH_STATE, 9.2, state="forming", previous="gathering", reason="members"),
        ev(
            Event.START,
            9.3,
            world_size=4,
            restart_count=0,
            generation=9,
            max_steps=100,
            began="replaced in place",
            replaced_ranks=[1],
            failed_at=8.9,
        ),
        ev(Event.RESUME, 9.4, step=14, world_size=4),
        ev(Event.FIRST_STEP, 9.5, step=15),
    ]
    first, second = timeline.build_timeline(events).attempts
    assert first.last_step == 14 and first.end == 9.0 and first.down_from == 9.0
    assert first.outcome == Outcome.LOST
    assert round(second.stall_s, 3) == 0.6 and second.trained_at - first.down_from == 0.5


def test_the_report_draws_each_ranks_straggler_score_and_names_the_straggler(tmp_path, capsys):
    """Issue 46: the scores of the periodic ``stragglers`` events over time, a star where a
    rank was named, and the name in the summary; a log without scores draws no such panel."""

    def scores(t: float, step: int, *values: float) -> dict:
        ranks = [{"rank": r, "median_s": v / 100, "score": v} for r, v in enumerate(values)]
        return ev(Event.STRAGGLERS, t, step=step, ranks=ranks)

    named = ev(Event.STRAGGLER, 4, step=30, rank=1, host="node7", slow=True, ratio=2.9, reports=3)
    events = [
        *attempt(0, 2, 0, 0),
        *(scores(t, 10 * t, 0.34, 2.9) for t in (2, 3, 4)),
        named,
        ev(Event.END, 5, step=40),
    ]
    tl = timeline.build_timeline(events)
    assert tl.attempts[0].scores == [(t, [0.34, 2.9]) for t in (2.0, 3.0, 4.0)]
    assert "stragglers rank 1 on node7 (2.9x at step 30)" in timeline.summary(tl)
    assert report.main([write_log(tmp_path, events), "-o", str(tmp_path / "r.svg")]) == 0
    drawn = (tmp_path / "r.svg").read_text()
    assert "straggler scores" in drawn and "rank 1 on node7" in drawn
    without = [e for e in events if e["event"] not in (Event.STRAGGLERS, Event.STRAGGLER)]
    assert (
        report.main([write_log(tmp_path, without, "b.jsonl"), "-o", str(tmp_path / "b.svg")]) == 0
    )
    assert "straggler scores" not in (tmp_path / "b.svg").read_text()
