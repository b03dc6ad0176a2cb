"""Wires one attempt together: env -> process groups -> resume -> loop -> final checkpoint.

Exit codes (errors.py): 0 finished; 75 preempted with a checkpoint committed; 2 bad input;
3 init timeout; 4 hang detected; 5 a collective or checkpoint barrier timed out; 6 the torchrun
agent died (orphaned worker); 7 storage stayed down past --storage-retry-deadline; 1 a crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from elastictrain import dist as edist
from elastictrain import stragglers
from elastictrain.checkpointing import Checkpointer, CheckpointSchedule
from elastictrain.config import RunConfig
from elastictrain.control import Control
from elastictrain.data import GlobalBatchSampler
from elastictrain.env import DistEnv, read_env
from elastictrain.errors import EXIT_PREEMPTED, CollectiveTimeoutError
from elastictrain.events import CONTEXT, EventLog, LastWords, SampleLog, setup_logging
from elastictrain.loop import Trainer
from elastictrain.progress import STATUS, Progress, live_terminal
from elastictrain.state import DataFingerprint
from elastictrain.task import Task, build_task
from elastictrain.watchdog import HangWatchdog, StopSignals, parse_signal

logger = logging.getLogger(__name__)


def run(cfg: RunConfig) -> int:
    env = read_env()
    agent_pid = os.getppid()  # under torchrun: the agent; recorded before anything can reparent us
    setup_logging(env.rank)
    # Installed first: a preemption during init or resume is remembered and honoured at step 1.
    signals = StopSignals([parse_signal(name) for name in cfg.preempt_signal])
    # Built before any process-group work, so a bad --task fails fast and identically everywhere.
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.task_options)
    sampler = GlobalBatchSampler(len(task.dataset), task.batch_size, cfg.seed)
    sampler.share(0, env.rank, env.world_size)  # validates world size against the batch
    device = edist.pick_device(env, task.model_devices)
    # Started before init: an orphan (agent gone) must exit even while it waits in init or resume.
    # The startup budget covers init + resume + the first step; init keeps its own hard bound.
    watchdog = HangWatchdog(
        cfg.hang_timeout,
        startup_s=cfg.init_timeout + cfg.checkpoint_timeout,
        agent_pid=agent_pid if env.launched_by_torchrun else None,
    ).start()
    try:
        t_init = time.monotonic()
        groups = edist.init_process_groups(
            env,
            device,
            init_timeout=cfg.init_timeout,
            collective_timeout=cfg.collective_timeout,
            checkpoint_timeout=cfg.checkpoint_timeout,
        )
        events = EventLog(cfg.event_log, enabled=env.is_rank0)
        init_s = time.monotonic() - t_init
        logger.info(
            "started: world size %d, restart %d, generation %d, device %s, init %.2fs",
            env.world_size,
            env.restart_count,
            groups.attempt.generation,
            device,
            init_s,
        )
        events.emit(
            "start",
            world_size=env.world_size,
            local_world_size=env.local_world_size,
            restart_count=env.restart_count,
            generation=groups.attempt.generation,
            host=socket.gethostname(),
            max_steps=cfg.max_steps,
            init_s=round(init_s, 4),
        )
        last_words = LastWords(cfg.event_log, env.rank)
        watchdog.last_words = last_words
        attached = (
            (lambda: os.getppid() == agent_pid) if env.launched_by_torchrun else (lambda: True)
        )
        try:
            return _Attempt(
                cfg, env, task, sampler, device, groups, events, watchdog, signals, attached
            ).train()
        except Exception as e:
            # Last words for the run report: why this attempt ended (it may also be a peer's death).
            last_words(type(e).__name__, str(e).splitlines()[0][:300])
            raise
    finally:
        STATUS.close()  # never leave a terminal on a half-drawn line
        watchdog.stop()
        edist.shutdown()


@contextlib.contextmanager
def _named_timeout(flag: str, value: float, what: str) -> Iterator[None]:
    """Turn a backend timeout into an error that names the knob and its value."""
    try:
        yield
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise CollectiveTimeoutError(
            f"{what} did not complete within {flag}={value:.0f}s: a rank is slower than that budget, "
            f"stuck, or gone. Raise {flag} above the worst expected skew, or see the straggler report. "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e


class _Attempt:
    """One attempt's training: resume, step, agree on stop/checkpoint/report, save."""

    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv,
        task: Task,
        sampler: GlobalBatchSampler,
        device: torch.device,
        groups: edist.ProcessGroups,
        events: EventLog,
        watchdog: HangWatchdog,
        signals: StopSignals,
        attached: Callable[[], bool],
    ) -> None:
        self.cfg, self.env, self.task, self.sampler, self.device = cfg, env, task, sampler, device
        self.groups, self.events, self.watchdog, self.signals = groups, events, watchdog, signals
        self.fingerprint = DataFingerprint(task.batch_size, len(task.dataset), cfg.seed)
        self.ckpt = Checkpointer(
            url=cfg.checkpoint_dir,
            storage_options=cfg.storage_options,
            retry_deadline=cfg.storage_retry_deadline,
            rank=env.rank,
            world_size=env.world_size,
            generation=groups.attempt.generation,
            control=groups.control,
            device=device,
            events=events,
            keep_last=cfg.keep_last,
            keep_every=cfg.keep_every_steps,
            read_mode=cfg.resume_read,
            on_failure=cfg.on_storage_failure,
            async_persist=cfg.async_checkpoint,
            attached=attached,
        )
        self.schedule = CheckpointSchedule(cfg.checkpoint_every_steps, cfg.checkpoint_every_seconds)

    def save(self, step: int, reason: str) -> bool:
        with (
            self.watchdog.phase("checkpoint", self.cfg.checkpoint_timeout),
            _named_timeout(
                "--checkpoint-timeout",
                self.cfg.checkpoint_timeout,
                f"the checkpoint barrier at step {step}",
            ),
        ):
            committed = self.ckpt.save(
                step=step,
                epoch=self.sampler.epoch_of(max(step - 1, 0)),
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                fingerprint=self.fingerprint,
                reason=reason,
            )
        # A skipped checkpoint restarts the clock too: storage that is down is not retried
        # every step, only at the next scheduled checkpoint.
        self.schedule.mark_saved()
        self.progress.last_checkpoint = self.ckpt.last_committed
        return committed

    def train(self) -> int:
        cfg, env = self.cfg, self.env
        startup: dict[str, float] = {}  # where a (re)start's time goes, for the first_step event
        with _named_timeout("--checkpoint-timeout", cfg.checkpoint_timeout, "resume"):
            t0 = time.monotonic()
            self.ckpt.preflight()
            t1 = time.monotonic()
            # A model-parallel task placed its own layers; otherwise the whole model goes here.
            self.model = (
                self.task.model if self.task.model_devices else self.task.model.to(self.device)
            )
            # The first optimizer construction imports torch._dynamo (about 1.5 s here).
            self.optimizer = self.task.make_optimizer(self.model.parameters())
            self.scheduler = (
                self.task.make_scheduler(self.optimizer) if self.task.make_scheduler else None
            )
            t2 = time.monotonic()
            resumed = self.ckpt.resume(self.model, self.optimizer, self.scheduler, self.fingerprint)
            self.ckpt.claim()
            startup.update(probe_s=t1 - t0, build_s=t2 - t1, resume_s=time.monotonic() - t2)
        # device_ids=None for a CPU model and for a module that spans devices (the tutorial's MP-DDP).
        single_gpu = self.device.type == "cuda" and not self.task.model_devices
        ddp = DDP(self.model, device_ids=[self.device.index] if single_gpu else None)
        sample_log = SampleLog(
            cfg.sample_log,
            rank=env.rank,
            world_size=env.world_size,
            generation=self.ckpt.generation,  # fenced: strictly above every earlier attempt
        )
        trainer = Trainer(
            task=self.task,
            model=ddp,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler,
            device=self.device,
            rank=env.rank,
            world_size=env.world_size,
            seed=cfg.seed,
            on_share=sample_log.record,
        )
        self.progress = Progress(
            world_size=env.world_size,
            start_step=resumed.step,
            max_steps=cfg.max_steps,
            every_s=cfg.log_every_seconds,
            events=self.events,
            enabled=env.is_rank0,
            restarts=env.restart_count,
            live=live_terminal(cfg.progress, sys.stderr),
        )
        self.progress.last_checkpoint = resumed.checkpoint_step
        if resumed.step < cfg.max_steps:
            with _named_timeout(
                "--collective-timeout", cfg.collective_timeout, "the first step's all-reduce"
            ):
                trainer.prime_buckets(resumed.step)

        loss = torch.zeros(())
        t_loop = time.monotonic()
        startup["ddp_s"] = t_loop - t2 - startup["resume_s"]  # DDP wrap + bucket priming
        # Diagnostic knob (0 = agree every step), for `bench --overhead` comparisons.
        interval = float(os.environ.get("ELASTICTRAIN_CONTROL_INTERVAL_S", "0.2"))
        control = Control(self.device, is_rank0=env.is_rank0, interval_s=interval)
        t_first = t_done = t_loop
        for step in range(resumed.step, cfg.max_steps):
            CONTEXT.step = step
            with _named_timeout(
                "--collective-timeout", cfg.collective_timeout, f"training step {step}"
            ):
                loss = trainer.step(step)
                done = step + 1
                CONTEXT.step = done
                self.watchdog.beat(done)
                if self.progress.live:
                    self.progress.last_checkpoint = self.ckpt.last_committed
                    self.progress.tick(done, loss)
                t_done = time.monotonic()
                if step == resumed.step:  # how long a (re)start took to get back to training
                    t_first = t_done
                    startup["step_s"] = t_done - t_loop
                    self.events.emit(
                        "first_step",
                        step=done,
                        loss=float(loss.item()) if env.is_rank0 else None,
                        **{k: round(v, 4) for k, v in startup.items()},
                    )
                decided = control.agree(
                    done,
                    stop=self.signals.requested,
                    by_time=env.is_rank0 and self.schedule.due_by_time(),
                    report=env.is_rank0 and self.progress.due(),
                    persist_failed=self.ckpt.failure is not None,
                )
                stop, by_time = decided.stop, decided.checkpoint_by_time
                if decided.persist_failed:
                    self.ckpt.raise_failure()
                if decided.report:
                    self.progress.last_checkpoint = self.ckpt.last_committed
                    self.progress.report(
                        done, loss, stragglers.gather(trainer.timer, self.groups.control)
                    )
            if stop:
                return self._preempted(done)
            if done < cfg.max_steps and (self.schedule.due_by_steps(done) or by_time):
                self.save(done, "time" if by_time else "steps")

        if resumed.step > cfg.max_steps:
            # Never label step-k state as an earlier step: there is nothing to train or save.
            logger.warning(
                "checkpoint is at step %d, past --max-steps %d; nothing to do",
                resumed.step,
                cfg.max_steps,
            )
        else:
            self.save(cfg.max_steps, "final")
        if resumed.step < cfg.max_steps:
            self.progress.report(cfg.max_steps, loss)
        self.progress.last_checkpoint = self.ckpt.last_committed
        self.progress.close()
        elapsed = time.monotonic() - t_loop
        trained = max(cfg.max_steps - resumed.step, 0)
        logger.info(
            "FINISHED %d steps (%d this attempt in %.1fs); exit 0", cfg.max_steps, trained, elapsed
        )
        self.events.emit(
            "end",
            step=max(cfg.max_steps, resumed.step),
            steps_this_attempt=trained,
            seconds=round(elapsed, 3),
            # Steady-state training time: from the first step's end to the last step's end.
            after_first_step_s=round(t_done - t_first, 6) if trained > 1 else None,
            skipped_checkpoints=self.ckpt.skipped,
        )
        return 0

    def _preempted(self, step: int) -> int:
        t0 = time.monotonic()
        self.save(step, "preempt")
        self.signals.announce(self.events, step, t0)
        return EXIT_PREEMPTED
