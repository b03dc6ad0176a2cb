"""Real 2-rank jobs checkpointing to S3 through a proxy that injects faults (fault_proxy.py); the
faults are the storage's, so the ranks start without torchrun's agent (plain ranks)."""

from __future__ import annotations

import pytest

import storage
from elastictrain.checkpoint.api import Reason
from elastictrain.observe.events import Event, read_events
from elastictrain.observe.history import merge_lines
from tests.helpers.fault_proxy import KINDS, FaultProxy
from tests.helpers.launcher import toy_args, wait_for_event

# botocore retries 5xx and dropped connections itself by default, which would hide most faults from
# our own retry layer; with one attempt each fault reaches s3fs and then storage.retry.
NO_BOTO_RETRIES = 'config_kwargs={"retries": {"total_max_attempts": 1}}'


def s3_args(url: str, ev: str, proxy_url: str, *extra: str, **kw) -> list[str]:
    return toy_args(
        url,
        ev,
        extra=(
            "--storage-option",
            f"endpoint_url={proxy_url}",
            "--storage-option",
            "key=testing",
            "--storage-option",
            "secret=s3cr3t-do-not-print",
            "--storage-option",
            NO_BOTO_RETRIES,
            *extra,
        ),
        **kw,
    )


def _events(ev: str, kind: str) -> list[dict]:
    return [e for e in read_events(ev) if e["event"] == kind]


@pytest.mark.slow
def test_ten_percent_faults_every_checkpoint_committed_or_reported(launch, tmp_path, s3_bucket):
    bucket_url, options = s3_bucket
    url, ev = f"{bucket_url}/faulty", str(tmp_path / "ev.jsonl")
    with FaultProxy(options["endpoint_url"], fail_fraction=0.10, seed=5) as proxy:
        args = s3_args(
            url,
            ev,
            proxy.url,
            "--keep-last",
            "3",
            "--keep-every-steps",
            "60",
            "--storage-retry-deadline",
            "60",
            max_steps=240,
            every=20,
            step_time=0.01,
        )
        job = launch(args, nproc=2, max_restarts=0, plain=True)
        assert job.wait(300) == 0, job.log()[-4000:]
        first = proxy.stats()
        # Resume through the same faults, and go on.
        again = launch(
            [*args[:5], "300", *args[6:]], nproc=2, max_restarts=0, name="again", plain=True
        )
        assert again.wait(300) == 0, again.log()[-4000:]
        stats = proxy.stats()
    log = job.log() + again.log()
    assert "s3cr3t" not in log + (tmp_path / "ev.jsonl").read_text()
    assert [e["step"] for e in _events(ev, Event.RESUME)] == [0, 240]

    scheduled = set(range(20, 301, 20))
    committed = {e["step"] for e in _events(ev, Event.CHECKPOINT)}
    skipped = {e["step"] for e in _events(ev, Event.CHECKPOINT_SKIPPED)}
    missing = scheduled - committed - skipped
    assert not missing, f"scheduled checkpoints neither committed nor reported skipped: {missing}"
    # Every committed checkpoint still present verifies, read over a clean connection.
    store = storage.open_store(url, storage_options=options)
    listed = store.list()
    # The history mirrored through the same faults: no checkpoint event twice (retries rewrite a
    # segment, never add one) and none missing but perhaps an exit's last flush (bounded at 5 s).
    segments = [data.decode() for _, data in store.read_history()]
    mirrored = [e["step"] for e in merge_lines(segments) if e["event"] == Event.CHECKPOINT]
    assert sum(text.count('"event": "checkpoint"') for text in segments) == len(mirrored)
    local = [e["step"] for e in _events(ev, Event.CHECKPOINT)]
    assert set(mirrored) <= set(local) and len(mirrored) >= len(local) - 2, (mirrored, local)
    assert not any("s3cr3t" in data.decode() for _, data in store.read_history())
    assert all(c.ok for c in listed), [c.error for c in listed if not c.ok]
    expected = {s for s in committed if s % 60 == 0} | set(sorted(committed)[-3:])
    assert {c.step for c in listed} == expected
    assert all(stats.get(f"fault_{kind}", 0) > 0 for kind in KINDS), stats
    our_retries = log.count("transient storage error during")
    assert our_retries > 0
    kinds = ", ".join(f"{k} {stats['fault_' + k]}" for k in KINDS)
    print(
        f"\n10% faults: {stats['requests']} storage requests, {stats['faults']} faults injected "
        f"({kinds}), {stats['retried']} retried "
        f"({our_retries} by storage.retry, the rest inside s3fs), first run "
        f"{first['faults']}/{first['requests']}; {len(committed)} committed, {len(skipped)} "
        f"skipped of {len(scheduled)} scheduled; {len(listed)} kept, all verify"
    )


@pytest.mark.slow
def test_storage_down_warn_skips_keeps_training_and_recovers(launch, tmp_path, s3_bucket):
    bucket_url, options = s3_bucket
    url, ev = f"{bucket_url}/down-warn", str(tmp_path / "ev.jsonl")
    with FaultProxy(options["endpoint_url"]) as proxy:
        args = s3_args(
            url,
            ev,
            proxy.url,
            "--storage-retry-deadline",
            "2",
            max_steps=200,
            every=20,
            step_time=0.02,
        )
        job = launch(args, nproc=2, max_restarts=0, plain=True)
        wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT and e["step"] >= 40, 120, job)
        proxy.down = True
        wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT_SKIPPED, 120, job)
        proxy.down = False
        assert job.wait(180) == 0, job.log()[-4000:]
    log = job.log()
    skipped = [e["step"] for e in _events(ev, Event.CHECKPOINT_SKIPPED)]
    committed = [e["step"] for e in _events(ev, Event.CHECKPOINT)]
    assert "CHECKPOINT SKIPPED" in log and "--on-storage-failure warn" in log
    assert skipped and not set(skipped) & set(committed)
    assert max(committed) == 200 and max(committed) > max(skipped)  # recovered, final committed
    (end,) = _events(ev, Event.END)
    assert end["skipped_checkpoints"] == len(skipped)
    assert all("s3cr3t" not in e["error"] for e in _events(ev, Event.CHECKPOINT_SKIPPED))
    listed = storage.open_store(url, storage_options=options).list()
    assert listed and all(c.ok for c in listed) and listed[-1].step == 200


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fail", "warn"])
def test_storage_down_stops_the_job_when_it_must(launch, tmp_path, s3_bucket, policy):
    """``fail``: the first checkpoint storage rejects stops the job. ``warn``: scheduled ones are
    skipped, but the final checkpoint cannot be, so the job still stops, with exit 7, not 0."""
    bucket_url, options = s3_bucket
    url, ev = f"{bucket_url}/down-{policy}", str(tmp_path / "ev.jsonl")
    with FaultProxy(options["endpoint_url"]) as proxy:
        args = s3_args(
            url,
            ev,
            proxy.url,
            "--storage-retry-deadline",
            "2",
            "--on-storage-failure",
            policy,
            max_steps=100,
            every=20,
            step_time=0.02,
        )
        job = launch(args, nproc=2, max_restarts=0, plain=True)
        wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT and e["step"] == 20, 120, job)
        proxy.down = True
        assert job.wait(180) != 0
    log = job.log()
    (failed,) = _events(ev, Event.CHECKPOINT_FAILED)
    assert failed["reason"] == (Reason.STEPS if policy == "fail" else Reason.FINAL)
    assert "CHECKPOINT FAILED" in log and log.count("FAILED (exit 7)") == 2, log[-4000:]
    assert "s3cr3t" not in log
    if policy == "warn":
        assert [e["step"] for e in _events(ev, Event.CHECKPOINT_SKIPPED)] == [40, 60, 80]
    # What was committed before the outage is intact.
    listed = storage.open_store(url, storage_options=options).list()
    assert [c.step for c in listed] == [20] and listed[0].ok


@pytest.mark.slow
def test_async_persist_on_slow_storage_waits_and_the_final_checkpoint_lands(
    launch, tmp_path, s3_bucket
):
    """Every request 0.05 s late: persists overlap the next checkpoint, which waits for them (never
    skips), the final checkpoint is committed before exit, and the result is bitwise the same as
    with --no-async-checkpoint."""
    from tests.helpers.launcher import assert_bitwise_equal, final_state

    bucket_url, options = s3_bucket
    runs = {}
    with FaultProxy(options["endpoint_url"], delay_s=0.05) as proxy:
        for mode in ("--async-checkpoint", "--no-async-checkpoint"):
            url, ev = f"{bucket_url}/{mode.strip('-')}", str(tmp_path / f"{mode}.jsonl")
            args = s3_args(url, ev, proxy.url, mode, max_steps=20, every=5, step_time=0.01)
            job = launch(args, nproc=2, max_restarts=0, name=mode.strip("-"), plain=True)
            assert job.wait(240) == 0, job.log()[-4000:]
            runs[mode] = (url, ev, job.log())
    url, ev, log = runs["--async-checkpoint"]
    checkpoints = _events(ev, Event.CHECKPOINT)
    assert [e["step"] for e in checkpoints] == list(range(5, 21, 5))
    assert any(e["waited_s"] > 0 for e in checkpoints) and "waited" in log
    assert checkpoints[-1]["reason"] == Reason.FINAL
    sync = _events(runs["--no-async-checkpoint"][1], Event.CHECKPOINT)
    # The loop is blocked for the snapshot (and any wait) instead of the whole persist.
    blocked_async = sorted(e["blocked_s"] - e["waited_s"] for e in checkpoints)
    blocked_sync = sorted(e["blocked_s"] for e in sync)
    assert blocked_async[len(blocked_async) // 2] < blocked_sync[len(blocked_sync) // 2]
    assert_bitwise_equal(
        final_state(url, storage_options=options),
        final_state(runs["--no-async-checkpoint"][0], storage_options=options),
    )
