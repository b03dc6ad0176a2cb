"""The process-level run: env -> process groups -> checkpoint session -> the attempt's training
(``attempt`` builds it, ``training`` runs it) -> the exit code.

Exit codes (errors.py): 0 finished; 75 stopped by a signal with a checkpoint committed; 130 a
second Ctrl-C; 2 bad input; 3 init timeout; 4 hang detected; 5 a collective or checkpoint barrier
timed out; 6 the torchrun agent died (orphaned worker); 7 storage stayed down past
--storage-retry-deadline; 8 a peer or the job's store went silent (liveness); 1 a crash.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from elastictrain import dist as edist
from elastictrain import mesh, streams, training
from elastictrain.attempt import Attempt
from elastictrain.checkpoint.session import CheckpointSession, install_stop_signals
from elastictrain.config import RunConfig
from elastictrain.data import GlobalBatchSampler
from elastictrain.env import read_env
from elastictrain.errors import EXIT_PREEMPTED, Preempted
from elastictrain.liveness import Liveness
from elastictrain.loader import check_micro_steps
from elastictrain.observe.events import LastWords
from elastictrain.observe.logs import setup_logging
from elastictrain.observe.terminal import STATUS
from elastictrain.signals import StopSignals
from elastictrain.task import build_task
from elastictrain.watchdog import HangWatchdog

logger = logging.getLogger(__name__)


def run(cfg: RunConfig, early_signals: StopSignals | None = None) -> int:
    """Train one attempt; the exit code. ``early_signals``: stop-signal handlers ``__main__``
    installed before importing torch, so a Ctrl-C even then is a graceful stop."""
    env = read_env()
    agent_pid = os.getppid()  # under torchrun: the agent; recorded before anything can reparent us
    setup_logging(env.rank)
    # Why this process ended early, for the run report: given to everything that may end it.
    last_words = LastWords(cfg.checkpoint.event_log, env.rank)
    # Installed first: a stop signal during init or resume is remembered and honoured at step 1,
    # and a Ctrl-C there never becomes a KeyboardInterrupt traceback.
    signals = install_stop_signals(cfg.checkpoint, early_signals, last_words)
    # Built before any process-group work, so a bad --task fails fast and identically everywhere.
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.task_options)
    shape = mesh.resolve(cfg.parallel, cfg.mesh, env.world_size, env.local_world_size)
    # The samples are split over the data-parallel ranks: one tensor-parallel group, one share.
    data = mesh.data_ranks(shape, env.rank, env.world_size)
    mesh.use(data)
    if streams.is_stream(task.dataset):  # no sampler: the stream says what comes next
        streams.check_stream(task.dataset, task.batch_size, data.size, cfg.grad_accum_steps)
        sampler = None
    else:
        sampler = GlobalBatchSampler(len(task.dataset), task.batch_size, cfg.seed)
        sampler.share(0, data.rank, data.size)  # validates the data-parallel size against the batch
    check_micro_steps(task.batch_size, data.size, cfg.grad_accum_steps)
    device = edist.pick_device(env, task.model_devices)
    # Started before init: an orphan (agent gone) must exit even while it waits in init or resume.
    # The startup budget covers init + resume + the first step; init keeps its own hard bound.
    watchdog = HangWatchdog(
        cfg.hang_timeout,
        startup_s=cfg.init_timeout + cfg.checkpoint.checkpoint_timeout,
        floor_s=cfg.hang_floor,
        agent_pid=agent_pid if env.launched_by_torchrun else None,
        last_words=last_words,
    )
    # Beats carry the watchdog's step and phase; the watchdog asks liveness whether a peer in a
    # gate excuses a slow step.
    liveness = Liveness(
        env.rank,
        env.world_size,
        interval_s=cfg.heartbeat_seconds,
        silent_s=cfg.silent_timeout,
        step=lambda: watchdog.step,
        phase=lambda: watchdog.phase_name,
        last_words=last_words,
    )
    watchdog.start(excuse=liveness.excuse)
    try:
        t_init = time.monotonic()
        groups = edist.init_process_groups(
            env,
            device,
            init_timeout=cfg.init_timeout,
            collective_timeout=cfg.collective_timeout,
            checkpoint_timeout=cfg.checkpoint.checkpoint_timeout,
            liveness=liveness,
        )
        attached = (
            (lambda: os.getppid() == agent_pid) if env.launched_by_torchrun else (lambda: True)
        )
        session = CheckpointSession(
            cfg.checkpoint,
            env=env,
            generation=groups.attempt.generation,
            gate=groups.control,
            # The default group (nccl on GPUs), on the training device: the per-step agreement must
            # be as cheap as the step's own collectives, and time out like them.
            agree_group=dist.group.WORLD,
            agree_device=device,
            watchdog=watchdog,
            attached=attached,
            signals=signals,
            last_words=last_words,
        )
        liveness.start()
        init_s = time.monotonic() - t_init
        logger.info(
            "started: world size %d%s, restart %d, generation %d, device %s, init %.2fs",
            env.world_size,
            f" (mesh {shape.describe()})" if shape else "",
            env.restart_count,
            groups.attempt.generation,
            device,
            init_s,
        )
        session.emit_start(max_steps=cfg.max_steps, init_s=round(init_s, 4))
        attempt = Attempt(cfg, env, task, sampler, device, groups, session, watchdog, shape)
        try:
            return training.train(attempt)
        except Preempted:
            return EXIT_PREEMPTED
        except Exception as e:
            # Last words for the run report: why this attempt ended (it may also be a peer's death).
            session.last_words(type(e).__name__, str(e).splitlines()[0][:300])
            raise
    finally:
        STATUS.close()  # never leave a terminal on a half-drawn line
        liveness.stop()
        watchdog.stop()
        edist.shutdown()
