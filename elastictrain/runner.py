"""Wires one attempt together: env -> process groups -> checkpoint session -> loop -> final save.

Exit codes (errors.py): 0 finished; 75 stopped by a signal with a checkpoint committed; 130 a
second Ctrl-C; 2 bad input; 3 init timeout; 4 hang detected; 5 a collective or checkpoint barrier
timed out; 6 the torchrun agent died (orphaned worker); 7 storage stayed down past
--storage-retry-deadline; 8 a peer or the job's store went silent (liveness); 1 a crash.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from elastictrain import dist as edist
from elastictrain import parallel, streams
from elastictrain.checkpoint.api import Reason
from elastictrain.checkpoint.checkpointer import Resumed
from elastictrain.checkpoint.session import CheckpointSession, install_stop_signals
from elastictrain.checkpoint.state import DataFingerprint, TrainState, check_plain, unwrap
from elastictrain.config import RunConfig
from elastictrain.data import GlobalBatchSampler
from elastictrain.env import DistEnv, read_env
from elastictrain.errors import EXIT_PREEMPTED, Preempted, named_timeout
from elastictrain.liveness import Liveness
from elastictrain.loader import StepLoader, check_micro_steps, worker_init
from elastictrain.loop import Trainer
from elastictrain.observe import stragglers
from elastictrain.observe.events import Event, SampleLog
from elastictrain.observe.logs import CONTEXT, setup_logging
from elastictrain.observe.metrics import evaluate
from elastictrain.observe.progress import Progress
from elastictrain.observe.tensorboard import Scalars
from elastictrain.observe.terminal import STATUS, live_terminal
from elastictrain.precision import Precision
from elastictrain.signals import StopSignals
from elastictrain.task import Task, build_task
from elastictrain.watchdog import HangWatchdog

logger = logging.getLogger(__name__)


def run(cfg: RunConfig, early_signals: StopSignals | None = None) -> int:
    """Train one attempt; the exit code. ``early_signals``: stop-signal handlers ``__main__``
    installed before importing torch, so a Ctrl-C even then is a graceful stop."""
    env = read_env()
    agent_pid = os.getppid()  # under torchrun: the agent; recorded before anything can reparent us
    setup_logging(env.rank)
    # Installed first: a stop signal during init or resume is remembered and honoured at step 1,
    # and a Ctrl-C there never becomes a KeyboardInterrupt traceback.
    signals = install_stop_signals(cfg.checkpoint, early_signals)
    # Built before any process-group work, so a bad --task fails fast and identically everywhere.
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.task_options)
    if streams.is_stream(task.dataset):  # no sampler: the stream says what comes next
        streams.check_stream(task.dataset, task.batch_size, env.world_size, cfg.grad_accum_steps)
        sampler = None
    else:
        sampler = GlobalBatchSampler(len(task.dataset), task.batch_size, cfg.seed)
        sampler.share(0, env.rank, env.world_size)  # validates world size against the batch
    check_micro_steps(task.batch_size, env.world_size, cfg.grad_accum_steps)
    device = edist.pick_device(env, task.model_devices)
    # Started before init: an orphan (agent gone) must exit even while it waits in init or resume.
    # The startup budget covers init + resume + the first step; init keeps its own hard bound.
    watchdog = HangWatchdog(
        cfg.hang_timeout,
        startup_s=cfg.init_timeout + cfg.checkpoint.checkpoint_timeout,
        floor_s=cfg.hang_floor,
        agent_pid=agent_pid if env.launched_by_torchrun else None,
    ).start()
    attempt: _Attempt | None = None
    liveness = Liveness.beside(watchdog, env.rank, env.world_size, cfg.heartbeat_seconds,
                               cfg.silent_timeout)  # fmt: skip
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
        )
        liveness.start(session.last_words)
        init_s = time.monotonic() - t_init
        logger.info(
            "started: world size %d, restart %d, generation %d, device %s, init %.2fs",
            env.world_size,
            env.restart_count,
            groups.attempt.generation,
            device,
            init_s,
        )
        session.emit_start(max_steps=cfg.max_steps, init_s=round(init_s, 4))
        attempt = _Attempt(cfg, env, task, sampler, device, groups, session, watchdog)
        try:
            return attempt.train()
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


class _Attempt:
    """One attempt's training: resume, step, report, save."""

    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv,
        task: Task,
        sampler: GlobalBatchSampler | None,
        device: torch.device,
        groups: edist.ProcessGroups,
        session: CheckpointSession,
        watchdog: HangWatchdog,
    ) -> None:
        self.cfg, self.env, self.task, self.sampler, self.device = cfg, env, task, sampler, device
        self.groups, self.session, self.events = groups, session, session.events
        self.watchdog = watchdog
        self.stream = (
            streams.StreamLoader(
                dataset=task.dataset,
                batch_size=task.batch_size,
                rank=env.rank,
                world_size=env.world_size,
                micro_steps=cfg.grad_accum_steps,
                collate_fn=task.collate_fn,
                num_workers=cfg.num_workers,
                prefetch_factor=cfg.prefetch_factor,
                pin_memory=device.type == "cuda",
                worker_init_fn=worker_init(),
                waiting=self._waiting,
            )
            if sampler is None
            else None
        )

    def _build(self, precision: Precision) -> TrainState:
        # A model-parallel task placed its own layers; otherwise the whole model goes here.
        model = self.task.model if self.task.model_devices else self.task.model.to(self.device)
        if self.cfg.parallel == "fsdp":  # before the optimizer: it steps the local shards
            parallel.shard(model, self.task.shard, self.device, self.env.world_size)
        # The first optimizer construction imports torch._dynamo: most of a restart's build time
        # (docs/performance.md, "recovery").
        optimizer = self.task.make_optimizer(model.parameters())
        scheduler = self.task.make_scheduler(optimizer) if self.task.make_scheduler else None
        for name, obj in self.task.state.items():
            # Now, not at the first checkpoint: what the payload cannot carry fails before training.
            check_plain(obj.state_dict(), f"Task.state[{name!r}].state_dict()")
        if self.task.hf_config is not None:
            check_plain(dict(self.task.hf_config), "Task.hf_config")
        return TrainState(
            model,
            optimizer,
            scheduler,
            fingerprint=DataFingerprint(
                self.task.batch_size,
                0 if self.stream else len(self.task.dataset),  # a stream has no length
                self.cfg.seed,
            ),
            epoch_of=lambda step: self.sampler.epoch_of(max(step - 1, 0)) if self.sampler else 0,
            stateful=self.task.state,
            scaler=precision.scaler,
            per_rank={"data_stream": self.stream} if self.stream else {},
            export_config=self.task.hf_config,
        )

    def _waiting(self) -> Any:
        # A hung or dead-slow worker is a hang like any other: stacks, exit 4, restart.
        return self.watchdog.phase(
            "waiting for the data loader", self.cfg.hang_timeout, "--hang-timeout"
        )

    def _loader(self, start: int) -> StepLoader | streams.StreamLoader:
        cfg = self.cfg
        if self.stream is not None:
            self.stream.start(start)
            return self.stream
        return StepLoader(
            task=self.task,
            sampler=self.sampler,
            rank=self.env.rank,
            world_size=self.env.world_size,
            micro_steps=cfg.grad_accum_steps,
            seed=cfg.seed,
            start=start,
            stop=cfg.max_steps,
            num_workers=cfg.num_workers,
            prefetch_factor=cfg.prefetch_factor,
            pin_memory=self.device.type == "cuda",
            waiting=self._waiting,
        )

    def _evaluate(self, step: int, model: torch.nn.Module, precision: Precision) -> None:
        """``Task.evaluate`` on every rank, averaged; rank 0 logs and records it."""
        cfg, watchdog = self.cfg, self.watchdog
        t0 = time.monotonic()
        with (
            watchdog.phase("evaluation", cfg.hang_timeout, "--hang-timeout", shared=True),
            named_timeout(
                "--checkpoint-timeout",
                cfg.checkpoint.checkpoint_timeout,
                f"evaluation at step {step}",
            ),
        ):
            metrics = evaluate(
                self.task.evaluate, unwrap(model), precision.autocast, self.groups.control
            )
        if self.env.is_rank0:
            logger.info(
                "eval step %d: %s", step, " ".join(f"{k} {v:.5g}" for k, v in metrics.items())
            )
            self.events.emit(
                Event.EVAL, step=step, metrics=metrics, seconds=round(time.monotonic() - t0, 4)
            )
            self.scalars.write(step, "eval", metrics)

    def train(self) -> int:
        cfg, env, session = self.cfg, self.env, self.session
        t0 = time.monotonic()
        precision = Precision(cfg.precision, self.device)
        # Before the preflight's first write: a task that cannot run (tied weights split over
        # FSDP groups, Task.state a checkpoint cannot carry) leaves the location untouched.
        state = self._build(precision)
        t1 = time.monotonic()
        session.preflight()
        t2 = time.monotonic()
        resumed = session.resume(state, self.device)
        t3 = time.monotonic()
        # Where a (re)start's time goes, for the first_step event. ddp_s (DDP wrap, loader,
        # bucket priming) runs from here to the loop's start, which adds its own clock to it.
        startup = {"build_s": t1 - t0, "probe_s": t2 - t1, "resume_s": t3 - t2, "ddp_s": -t3}
        if self.cfg.parallel == "ddp":
            model = parallel.wrap_ddp(state.model, self.device, self.task.model_devices)
        else:
            model = state.model  # sharded in place by _build
        sample_log = SampleLog(
            cfg.sample_log,
            rank=env.rank,
            world_size=env.world_size,
            generation=session.generation,  # fenced: strictly above every earlier attempt
        )
        self.scalars = Scalars(cfg.tensorboard, resume_step=resumed.step, enabled=env.is_rank0)
        loader = self._loader(resumed.step)
        trainer = Trainer(
            task=self.task,
            model=model,
            optimizer=state.optimizer,
            scheduler=state.scheduler,
            loader=loader,
            precision=precision,
            device=self.device,
            rank=env.rank,
            seed=cfg.seed,
            clip_grad_norm=cfg.clip_grad_norm,
            on_share=sample_log.record,
        )
        try:
            return self._loop(state, trainer, resumed, startup)
        finally:
            loader.close()
            self.scalars.close()

    def _loop(
        self, state: TrainState, trainer: Trainer, resumed: Resumed, startup: dict[str, float]
    ) -> int:
        cfg, env, session = self.cfg, self.env, self.session
        progress = Progress(
            world_size=env.world_size,
            start_step=resumed.step,
            max_steps=cfg.max_steps,
            every_s=cfg.log_every_seconds,
            events=self.events,
            enabled=env.is_rank0,
            restarts=env.restart_count,
            live=live_terminal(cfg.progress, sys.stderr),
        )
        progress.last_checkpoint = resumed.checkpoint_step
        if resumed.step < cfg.max_steps and cfg.parallel == "ddp":
            with named_timeout(
                "--collective-timeout", cfg.collective_timeout, "the first step's all-reduce"
            ):
                trainer.prime_buckets(resumed.step)

        loss = torch.zeros(())

        def report(step: int, stragglers=None) -> None:
            """Every rank (the means are one all-reduce); rank 0 logs and records."""
            means, fields = trainer.summary(dist.group.WORLD)
            metrics = {k: v for k, v in means.items() if k != "loss"}
            progress.report(step, means.get("loss", loss), stragglers, metrics=metrics, **fields)
            self.scalars.write(step, "train", {**means, **fields})

        t_loop = time.monotonic()
        startup["ddp_s"] += t_loop
        t_first = t_done = t_loop
        for step in range(resumed.step, cfg.max_steps):
            CONTEXT.step = step
            with named_timeout(
                "--collective-timeout", cfg.collective_timeout, f"training step {step}"
            ):
                loss = trainer.step(step)
                done = step + 1
                CONTEXT.step = done
                if progress.live:
                    progress.last_checkpoint = session.last_committed
                    progress.last_local = session.last_local
                    progress.tick(done, loss)
                t_done = time.monotonic()
                if step == resumed.step:  # how long a (re)start took to get back to training
                    t_first = t_done
                    startup["step_s"] = t_done - t_loop
                    self.events.emit(
                        Event.FIRST_STEP,
                        step=done,
                        loss=float(loss.item()) if env.is_rank0 else None,
                        **{k: round(v, 4) for k, v in startup.items()},
                    )
                if self._eval_due(done):
                    self._evaluate(done, trainer.model, trainer.precision)
                outcome = session.step(
                    done, state, report=progress.due(), may_save=done < cfg.max_steps
                )
                # The last step's report comes after the final checkpoint, once: a report agreed
                # at the last step too would record the final step twice.
                if outcome.report and done < cfg.max_steps:
                    progress.last_checkpoint = session.last_committed
                    progress.last_local = session.last_local
                    report(done, stragglers.gather(trainer.timer, self.groups.control))

        if resumed.step > cfg.max_steps:
            # Never label step-k state as an earlier step: there is nothing to train or save.
            logger.warning(
                "checkpoint is at step %d, past --max-steps %d; nothing to do",
                resumed.step,
                cfg.max_steps,
            )
        else:
            session.save(cfg.max_steps, state, Reason.FINAL)
        progress.last_checkpoint = session.last_committed
        if resumed.step < cfg.max_steps:
            report(cfg.max_steps)
            if self.task.evaluate is not None:
                self._evaluate(cfg.max_steps, trainer.model, trainer.precision)  # the final score
        progress.close()
        session.close()
        elapsed = time.monotonic() - t_loop
        trained = max(cfg.max_steps - resumed.step, 0)
        logger.info(
            "FINISHED %d steps (%d this attempt in %.1fs); exit 0", cfg.max_steps, trained, elapsed
        )
        session.emit_end(
            max(cfg.max_steps, resumed.step),
            steps_this_attempt=trained,
            seconds=round(elapsed, 3),
            # Steady-state training time: from the first step's end to the last step's end.
            after_first_step_s=round(t_done - t_first, 6) if trained > 1 else None,
            skipped_checkpoints=session.skipped_checkpoints,
            **({"overflow_skips": trainer.overflow_skips} if trainer.precision.scaler else {}),
        )
        return 0

    def _eval_due(self, done: int) -> bool:
        every = self.cfg.eval_every_steps
        # The last step's eval runs after the final checkpoint instead.
        return (
            self.task.evaluate is not None
            and every is not None
            and done % every == 0
            and done < self.cfg.max_steps
        )
