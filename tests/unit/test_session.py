"""elastictrain.checkpoint.session: the sequence both the runner and library mode drive, on one
rank of a real gloo group, on memory://."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

import storage
from elastictrain.checkpoint.api import Reason
from elastictrain.checkpoint.session import CheckpointSession
from elastictrain.config import CheckpointConfig, flag
from elastictrain.errors import CheckpointFailedError, CollectiveTimeoutError, Preempted
from elastictrain.observe.events import Event, read_events
from elastictrain.runtime.signals import StopSignals
from tests.helpers.one_process import memory_url, one_rank, state, train

CPU = torch.device("cpu")


def session(tmp_path, group, signals=None, **settings) -> CheckpointSession:
    settings.setdefault("local_checkpoint", False)
    config = CheckpointConfig(
        checkpoint_dir=settings.pop("checkpoint_dir", memory_url()),
        event_log=str(tmp_path / "events.jsonl"),
        **settings,
    )
    return CheckpointSession(config, env=one_rank(), generation=1, gate=group, signals=signals)


def test_steps_save_on_schedule_and_the_final_save_commits(tmp_path, gloo_world):
    s, ses = state(), session(tmp_path, gloo_world, checkpoint_every_steps=3)
    assert ses.resume(s, CPU).step == 0
    saved = []
    for step in range(7):
        train(s, step)
        saved.append(ses.step(step + 1, s).saved)
    assert saved == [False, False, True, False, False, True, False]
    ses.save(7, s, Reason.FINAL)
    ses.close()
    assert ses.last_committed == 7 and ses.skipped_checkpoints == 0
    assert storage.open_store(ses.config.checkpoint_dir).committed_steps() == [3, 6, 7]


def test_a_stop_signal_commits_the_current_step_then_raises_preempted(tmp_path, gloo_world):
    signals = StopSignals([signal.SIGUSR1], interrupt=False)
    s = state()
    ses = session(tmp_path, gloo_world, signals=signals, checkpoint_every_steps=100)
    try:
        ses.resume(s, CPU)
        train(s, 0)
        ses.step(1, s)
        os.kill(os.getpid(), signal.SIGUSR1)
        train(s, 1)
        with pytest.raises(Preempted) as stopped:
            ses.step(2, s)
        assert (stopped.value.code, stopped.value.step) == (75, 2) and ses.last_committed == 2
    finally:
        ses.close()  # gives the handler back
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    kinds = [e["event"] for e in read_events(str(tmp_path / "events.jsonl"))]
    assert kinds[-2:] == [Event.CHECKPOINT, Event.PREEMPTED]


def test_a_stop_told_before_the_first_step_ends_the_epoch_before_it_trains(tmp_path, gloo_world):
    """``stop_if_told``: a stop that came while an epoch formed and loaded ends it before a step
    (an in-place replacement, stopped by torchrun mid-recovery, once trained a step at world
    size 1 and committed it). The resumed step is committed again only when newer than the
    durable tier's newest; untold, nothing happens."""
    url, s = memory_url(), state()
    for told_at, resumed, committed in [(None, 0, None), (1, 1, 1), (1, 2, 2)]:
        signals = StopSignals([signal.SIGUSR1], interrupt=False)
        ses = session(tmp_path, gloo_world, signals=signals, checkpoint_dir=url)
        try:
            ses.resume(s, CPU)
            if told_at is None:
                ses.stop_if_told(0, s)  # untold: it goes on
                train(s, 0)
                ses.save(1, s, Reason.FINAL)
                continue
            if resumed == 2:
                train(s, 1)  # a state newer than the committed one: a survivor's
            os.kill(os.getpid(), signal.SIGUSR1)
            with pytest.raises(Preempted) as stopped:
                ses.stop_if_told(resumed, s)
            assert stopped.value.step == resumed and ses.last_committed == committed
        finally:
            ses.close()
    assert storage.open_store(url).committed_steps() == [1, 2]
    kinds = [e["event"] for e in read_events(str(tmp_path / "events.jsonl"))]
    assert kinds.count(Event.PREEMPTED) == 2


def test_close_raises_when_the_last_background_persist_failed(tmp_path, gloo_world):
    s, where = state(), tmp_path / "ckpt"
    ses = session(
        tmp_path, gloo_world, checkpoint_dir=str(where), checkpoint_every_steps=1,
        on_storage_failure="fail", storage_retry_deadline=0.5,
    )  # fmt: skip
    ses.resume(s, CPU)
    # The run's history is written beside the checkpoints, on its own thread: let it land first.
    ses.history.flush(wait_s=10)
    shutil.rmtree(where)
    where.write_text("a file where the folder was: every write fails from here on")
    train(s, 0)
    ses.step(1, s)
    with pytest.raises(CheckpointFailedError, match="steps checkpoint at step 1 .*background"):
        ses.close()


@pytest.mark.parametrize(
    "spell, named", [(None, "checkpoint_timeout"), (flag, "--checkpoint-timeout")]
)
def test_a_gate_that_times_out_names_the_setting_as_the_user_spells_it(tmp_path, spell, named):
    config = CheckpointConfig(checkpoint_dir=memory_url(), checkpoint_timeout=7, spell=spell)
    ses = CheckpointSession(config, env=one_rank(), generation=1, gate=None)
    timeout = pytest.raises(CollectiveTimeoutError, match=f"within {named}=7s")
    with timeout, ses.gate("checkpoint", "the steps checkpoint at step 3"):
        raise RuntimeError("Gloo: timed out waiting for peers")
