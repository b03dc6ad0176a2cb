"""Library mode (CheckpointManager) in one process: schedule, resume, extra state, retention,
map_location and the errors. The killed multi-process custom loop is in test_examples."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from elastictrain import CheckpointManager, Preempted, load_checkpoint
from elastictrain.checkpoint.api import Tier
from elastictrain.errors import CheckpointMismatchError, ConfigError, NumericalFaultError
from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import job_env
from tests.helpers.one_process import build, train_step


def run(url: str, steps: int, **kw) -> tuple[nn.Module, CheckpointManager]:
    model, opt, sched = build()
    with CheckpointManager(url, checkpoint_every_steps=4, keep_last=2, **kw) as ckpt:
        start = ckpt.resume(model, opt, sched)
        for step in range(start, steps):
            loss = train_step(model, opt, sched, step)
            ckpt.step(step + 1, model, opt, sched, extra={"loss": loss, "seen": step + 1})
        ckpt.save(steps, model, opt, sched, extra={"done": True}, final=True)
    return model, ckpt


@pytest.mark.parametrize("async_save", [True, False])
def test_custom_loop_stopped_and_resumed_equals_one_straight_run(tmp_path, async_save):
    straight, _ = run(str(tmp_path / "straight"), 20, async_checkpoint=async_save)
    url = str(tmp_path / "split")
    model, opt, sched = build()
    with CheckpointManager(
        url, checkpoint_every_steps=4, keep_last=2, async_checkpoint=async_save
    ) as ckpt:
        assert ckpt.resume(model, opt, sched) == 0 and ckpt.extra is None
        for step in range(10):  # then "crash": steps 9 and 10 are lost, 8 is the newest checkpoint
            train_step(model, opt, sched, step)
            ckpt.step(step + 1, model, opt, sched, extra={"seen": step + 1})
    resumed, ckpt = run(url, 20)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    state = load_checkpoint(url)
    # Step 20 was committed by step(); the final save of the same step is not written twice.
    assert state["progress"]["step"] == 20 and state["extra"]["seen"] == 20
    assert ckpt.last_committed == 20
    # Retention: keep_last=2 of 4, 8, 12, 16, 20 (and the final).
    import storage

    assert storage.open_store(url).committed_steps() == [16, 20]
    # The end event states the run's goodput over both attempts, from the history beside it.
    from elastictrain.observe.goodput import CAUSES
    from elastictrain.observe.history import merge_lines

    history = storage.open_store(url).read_history()
    events = merge_lines([data.decode() for _, data in history])
    (end,) = [e for e in events if e["event"] == Event.END]
    starts = [e["time"] for e in events if e["event"] == Event.START]
    assert len(starts) == 2 and end["wall_s"] == pytest.approx(end["time"] - starts[0], abs=0.01)
    assert set(end["lost_s"]) == set(CAUSES) and end["lost_s"]["restart"] > 0, end
    assert 0 < end["effective_training_ratio"] < 1, end


def test_crashes_resume_from_the_newest_local_copy_past_a_corrupt_one_and_end_equal(tmp_path):
    """The local tier in library mode (the session the runner shares): a crash resumes from the
    local copy newer than the durable tier's and reads no durable state; a corrupt newest copy
    falls back, reported, to the next good one (the same step locally beats the durable copy);
    the run ends equal to a straight one and a finished run removes its local copies."""
    import storage
    from storage.manifest import step_dir_name

    straight, _ = run(str(tmp_path / "straight"), 20)
    url, local, ev = str(tmp_path / "durable"), tmp_path / "local", str(tmp_path / "ev.jsonl")
    kw = dict(local_checkpoint_dir=str(local), local_every_steps=3, event_log=ev)
    model, opt, sched = build()

    def attempt(steps: int, final: bool = False) -> int:
        with CheckpointManager(url, checkpoint_every_steps=4, keep_last=2, **kw) as ckpt:
            start = ckpt.resume(model, opt, sched)
            for step in range(start, steps):
                train_step(model, opt, sched, step)
                ckpt.step(step + 1, model, opt, sched)
            if final:
                ckpt.save(steps, model, opt, sched, final=True)
        return start

    assert attempt(10) == 0  # "crash" after step 10: durable 4, 8; local 6, 9
    assert attempt(15) == 9  # durable 12; local 12, 15
    local_store = storage.open_store(str(local))
    assert local_store.committed_steps() == [12, 15]
    newest = local / step_dir_name(15)
    state_file = next(p for p in newest.iterdir() if p.name.startswith("state-"))
    raw = bytearray(state_file.read_bytes())
    raw[len(raw) // 2] ^= 1
    state_file.write_bytes(bytes(raw))
    assert attempt(20, final=True) == 12
    for a, b in zip(straight.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    resumes = [e for e in read_events(ev) if e["event"] == Event.RESUME and not e["fresh"]]
    assert [(e["step"], e["tier"], e["remote_bytes"], e["durable_step"]) for e in resumes] == [
        (9, Tier.LOCAL, 0, 8),
        (12, Tier.LOCAL, 0, 12),
    ]
    assert resumes[0]["steps_saved"] == 1
    corrupt = [e for e in read_events(ev) if e["event"] == Event.CORRUPT]
    assert [(e["step"], e["tier"]) for e in corrupt] == [(15, Tier.LOCAL)]
    assert not local.exists()  # the finished run removed its local tier


def test_resume_hands_back_extra_and_maps_to_the_requested_device(tmp_path):
    url = str(tmp_path / "c")
    run(url, 6)  # final extra {"done": True}; the step-4 one held {"loss": ..., "seen": 4}
    model, opt, sched = build(seed=1)
    ckpt = CheckpointManager(url, map_location="cpu")
    assert ckpt.resume(model, opt, sched) == 6 and ckpt.extra == {"done": True}
    assert sched.last_epoch == 6 and all(p.device.type == "cpu" for p in model.parameters())


def test_a_checkpoint_of_another_model_is_refused_and_kept(tmp_path):
    url = str(tmp_path / "c")
    run(url, 4)
    model, opt, sched = build(width=16)
    with pytest.raises(CheckpointMismatchError, match="shape mismatch"):
        CheckpointManager(url).resume(model, opt, sched)
    assert load_checkpoint(url)["progress"]["step"] == 4  # untouched


@pytest.mark.parametrize("async_save", [True, False])
def test_a_state_holding_a_nan_is_never_committed_and_every_tier_keeps_its_finite_copies(
    tmp_path, async_save
):
    """The commit path reads the copy it would write: a NaN in a weight (a buffer or a device
    gone bad; the runner never applies a non-finite gradient) stops the save with
    NumericalFaultError naming the tensor, in the background too, and nothing of that step is
    committed on either tier."""
    import storage

    url = str(tmp_path / "c")
    model, opt, sched = build()
    local = str(tmp_path / "local")
    with (
        pytest.raises(
            NumericalFaultError, match=r"step 8 would hold non-finite .* in model\.2\.bias"
        ),
        CheckpointManager(
            url,
            checkpoint_every_steps=4,
            async_checkpoint=async_save,
            local_checkpoint_dir=local,
            local_every_steps=2,
        ) as ckpt,
    ):
        ckpt.resume(model, opt, sched)
        for step in range(12):
            train_step(model, opt, sched, step)
            if step + 1 == 8:
                with torch.no_grad():
                    model[2].bias.fill_(float("nan"))
            ckpt.step(step + 1, model, opt, sched)
    assert storage.open_store(url).committed_steps() == [4]
    assert torch.isfinite(load_checkpoint(url)["model"]["2.bias"]).all()
    assert max(storage.open_store(local).committed_steps()) == 6


def test_misuse_gets_errors_that_name_the_fix(tmp_path):
    model, opt, sched = build()
    ckpt = CheckpointManager(str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"call resume\(model, optimizer\) once"):
        ckpt.save(1, model, opt)
    with pytest.raises(ConfigError, match=r"every_steps must be a positive whole number .*got -1"):
        CheckpointManager(str(tmp_path / "c"), checkpoint_every_steps=-1)
    with pytest.raises(ConfigError, match="keep_last must be > 0, got 0"):
        CheckpointManager(str(tmp_path / "c"), keep_last=0)
    with pytest.raises(ConfigError, match="on_storage_failure must be 'warn' or 'fail'"):
        CheckpointManager(str(tmp_path / "c"), on_storage_failure="ignore")
    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal name"):
        CheckpointManager(str(tmp_path / "c"), preempt_signals=["SIGNOPE"])
    ckpt.close()


def test_sigterm_commits_the_current_step_then_stops_with_75(tmp_path):
    url = str(tmp_path / "p")
    before = signal.getsignal(signal.SIGTERM)
    model, opt, sched = build()
    ckpt = CheckpointManager(
        url, checkpoint_every_steps=100, async_checkpoint=True, event_log=str(tmp_path / "e")
    )
    assert signal.getsignal(signal.SIGTERM) != before  # ours: a flag, not the default death
    ckpt.resume(model, opt, sched)
    with pytest.raises(Preempted) as stopped, ckpt:
        for step in range(50):
            train_step(model, opt, sched, step)
            if step == 6:
                os.kill(os.getpid(), signal.SIGTERM)  # the preemption, mid-loop
            ckpt.step(step + 1, model, opt, sched, extra={"seen": step + 1})
    assert stopped.value.code == 75 and 7 <= stopped.value.step < 50
    state = load_checkpoint(url)  # committed, although async_save: the process is about to go
    assert state["progress"]["step"] == stopped.value.step == state["extra"]["seen"]
    for a, b in zip(model.state_dict().values(), state["model"].values(), strict=True):
        assert torch.equal(a, b)
    (event,) = [e for e in read_events(str(tmp_path / "e")) if e["event"] == Event.PREEMPTED]
    assert event["signal"] == "SIGTERM" and event["step"] == stopped.value.step
    assert signal.getsignal(signal.SIGTERM) == before  # close() handed the process back
    # Opting out leaves the handlers alone.
    CheckpointManager(url, preempt_signals=()).close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_time_schedule_saves_on_rank0s_clock(tmp_path):
    model, opt, sched = build()
    ckpt = CheckpointManager(
        str(tmp_path / "c"), checkpoint_every_seconds=3600, async_checkpoint=False
    )
    ckpt.resume(model, opt, sched)
    assert not ckpt.step(1, model, opt, sched)  # an hour has not passed
    ckpt._session.schedule._last -= 7200  # now it has
    train_step(model, opt, sched, 1)
    assert ckpt.step(2, model, opt, sched) and ckpt.last_committed == 2
    ckpt.close()


HUNG_LOOP = """
import sys, time, torch
from elastictrain import CheckpointManager
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = CheckpointManager(sys.argv[1], checkpoint_every_steps=2, hang_timeout=1.0, preempt_signals=())
ckpt.resume(model, opt)
for step in range(3):
    ckpt.step(step + 1, model, opt)
def stuck_in_a_collective():
    time.sleep(60)
stuck_in_a_collective()
"""


def test_hang_timeout_dumps_stacks_and_exits_4(tmp_path):
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HUNG_LOOP, str(tmp_path / "h")],
        capture_output=True,
        text=True,
        timeout=60,
        env=job_env(),
    )
    assert done.returncode == 4, done.stderr
    assert time.monotonic() - t0 < 30  # the watchdog, not the sleep, ended it
    assert "HANG DETECTED: no progress for" in done.stderr and "after step 3" in done.stderr
    assert "(budget 1s, from hang_timeout)" in done.stderr  # the setting to raise, by its name
    assert "stuck_in_a_collective" in done.stderr  # the stack shows where it waited
    assert load_checkpoint(str(tmp_path / "h"))["progress"]["step"] == 2  # saves were not hangs
    with pytest.raises(ConfigError, match="hang_timeout must be > 0, got 0"):
        CheckpointManager(str(tmp_path / "h"), hang_timeout=0)


def test_close_ends_every_thread_the_manager_started(tmp_path):
    """A script that ends normally must exit 0: any thread still alive at interpreter teardown
    can abort the process ("terminate called without an active exception"), which torchrun
    counts as a failure. So close() ends them all: the history writer, the hash helper (the
    state here is big enough to be hashed beside its write) and the hang watchdog."""
    import threading

    from storage.hashing import stop_hasher

    stop_hasher()  # the helper is shared by the process: another test may have started it
    before = set(threading.enumerate())
    model = nn.Linear(1200, 1200)  # 17 MB with Adam's moments: hashed on a helper thread
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    with CheckpointManager(
        str(tmp_path / "c"),
        checkpoint_every_steps=2,
        event_log=str(tmp_path / "ev.jsonl"),
        hang_timeout=60,
        local_checkpoint_dir=str(tmp_path / "local"),
        local_every_steps=1,
    ) as ckpt:
        ckpt.resume(model, opt, sched)
        for step in range(4):
            model(torch.randn(2, 1200)).sum().backward()
            opt.step()
            ckpt.step(step + 1, model, opt, sched)
        ckpt.save(4, model, opt, sched, final=True)
        started = {t.name for t in set(threading.enumerate()) - before}
        assert {"elastictrain-history", "storage-hash_0", "elastictrain-watchdog"} <= started, (
            started
        )
    left = set(threading.enumerate()) - before
    assert not left, sorted(t.name for t in left)
    assert os.listdir(tmp_path / "c" / "events")  # the history reached storage before its end


@pytest.mark.parametrize(
    ("shared_store", "built_here", "warned"),
    [(True, False, True), (False, False, False), (True, True, False)],
    ids=["tutorial-init-on-torchruns-store", "torchrun-without-a-shared-store", "init_distributed"],
)
def test_a_plain_init_process_group_on_torchruns_shared_store_is_named_once_with_the_fix(
    tmp_path, monkeypatch, caplog, gloo_world, shared_store, built_here, warned
):
    """A tutorial loop keeps its own ``init_process_group`` under torchrun, and about half its
    restarts after a kill -9 can fail or hang (issue 36). The manager says so once, with the fix;
    not when torchrun's store is not shared, nor when ``init_distributed`` built the group."""

    from elastictrain.checkpoint import manager
    from elastictrain.cluster import groups

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(shared_store))
    monkeypatch.setattr(groups, "_built_on_a_fresh_store", built_here)
    monkeypatch.setattr(manager, "_warned_restart_unsafe", False)
    with caplog.at_level("WARNING", logger=manager.__name__):
        for _ in range(2):
            CheckpointManager(str(tmp_path / "c")).close()
    said = [r.getMessage() for r in caplog.records if "connectFullMesh" in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert "elastictrain.init_distributed()" in said[0]
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said[0]


def test_run_in_place_refuses_a_sharded_model_before_training(tmp_path, monkeypatch):
    """A sharded model cannot be rebuilt over a new mesh by the manager (only the code that
    built it can): under replace_in_place, run() refuses it with the fix, before any step."""
    from types import SimpleNamespace

    from elastictrain import library

    model, opt, sched = build()
    with CheckpointManager(str(tmp_path / "c"), checkpoint_every_steps=4) as ckpt:
        ckpt.resume(model, opt, sched)
        in_place = SimpleNamespace(settings=SimpleNamespace(replace_in_place=True), epoch=None)
        monkeypatch.setattr(library, "_driver", in_place)  # as under replace_in_place
        monkeypatch.setattr(library, "is_sharded", lambda m: m is model)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ConfigError, match="--replace-in-place --parallel fsdp"):
            ckpt.run(lambda step, net: None, model, opt, sched, start=0, stop=3)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_run_primes_ddps_buckets_after_each_wrap_and_the_prime_leaves_no_trace(tmp_path):
    """DDP orders its gradient buckets anew after its first backward; past two ranks that order
    is gloo's summation order, so a step redone right after a wrap summed in another order than
    an uninterrupted run (4 ranks: every tensor off by about 2e-7). ``run`` primes after each
    wrap, as the runner does: one discarded call in eval mode, the random state kept. Here (one
    rank, where DDP sums nothing) the prime is seen and the model is that of a loop without it.
    (Seen failing without the prime: no eval-mode call.)"""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def train(wrap, tag: str):
        model, opt, sched = build()
        calls = []

        def step_fn(step: int, net: nn.Module) -> dict:
            noise = float(torch.rand(()))  # the user's own randomness: the prime must not move it
            calls.append((step, net.training, noise))
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step)) + noise
            (net(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
            return {"step": step}

        torch.manual_seed(7)
        with CheckpointManager(str(tmp_path / tag), checkpoint_every_steps=100) as ckpt:
            ckpt.resume(model, opt, sched)
            ckpt.run(step_fn, model, opt, sched, start=0, stop=4, wrap=wrap)
        return model, calls

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp_model, ddp_calls = train(DistributedDataParallel, "ddp")
        plain_model, plain_calls = train(None, "plain")
    finally:
        dist.destroy_process_group()
    assert [(s, training) for s, training, _ in ddp_calls] == [(0, False)] + [
        (s, True) for s in range(4)
    ]
    assert ddp_calls[0][2] == ddp_calls[1][2]  # the prime drew what the real step 0 then drew
    assert [c[2] for c in ddp_calls[1:]] == [c[2] for c in plain_calls]
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            ddp_model.state_dict().values(), plain_model.state_dict().values(), strict=True
        )
    )
