"""One attempt's training loop: resume, step, report, checkpoint, and the final save.

The step itself is ``loop.Trainer``'s; what the attempt trains with is ``attempt.Attempt``'s;
what every rank agrees on after each step (stop, save, report) is the checkpoint session's.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastictrain.checkpoint.api import Reason
from elastictrain.checkpoint.checkpointer import Resumed
from elastictrain.checkpoint.resume import live_shards
from elastictrain.checkpoint.resume.live import Live
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.state import TrainState
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.config import RunConfig
from elastictrain.errors import (
    NodeEvictedError,
    named_timeout,
)
from elastictrain.inplace import epoch_end
from elastictrain.inplace.driver import EpochDriver
from elastictrain.inplace.members import LiveState, PeerLost
from elastictrain.observe import stragglers
from elastictrain.observe.events import Event, SampleLog
from elastictrain.observe.logs import CONTEXT
from elastictrain.observe.progress import Progress
from elastictrain.observe.tensorboard import Scalars
from elastictrain.observe.terminal import live_terminal
from elastictrain.step_list import parse_steps
from elastictrain.train import health, numerics, replicas, rollback
from elastictrain.train.attempt import Attempt
from elastictrain.train.loop import Trainer
from elastictrain.train.precision import Precision

logger = logging.getLogger(__name__)


def train(attempt: Attempt, live: Live | None, driver: EpochDriver) -> int:
    """Every rank: resume, train to ``--max-steps``, commit the final checkpoint; 0 when done.
    ``live``: an in-place epoch, resumed from a survivor's memory. Raises :class:`PeerLost`
    under ``--replace-in-place`` when a peer's process died (``driver``: the epoch's, which
    tells), with this rank's state."""
    cfg, env, session = attempt.cfg, attempt.env, attempt.session
    t0 = time.monotonic()
    precision = Precision(cfg.precision, attempt.device)
    # Before the preflight's first write: a task that cannot run (tied weights split over
    # FSDP groups, Task.state a checkpoint cannot carry) leaves the location untouched.
    state = attempt.build_state(precision)
    t1 = time.monotonic()
    if live is None:  # an in-place epoch's location was proven by the epoch before
        session.preflight()
    t2 = time.monotonic()
    resumed = session.resume(state, attempt.device, live)
    driver.training(resumed.step)
    t3 = time.monotonic()
    # Where a (re)start's time goes, for the first_step event. ddp_s (DDP wrap, loader,
    # bucket priming) runs from here to the loop's start, which adds its own clock to it.
    startup = {"build_s": t1 - t0, "probe_s": t2 - t1, "resume_s": t3 - t2, "ddp_s": -t3}
    replica = attempt.replica if live is not None else None  # in place, DDP: kept or primed alone
    if replica is not None:
        model = replica.wrap(state.model, attempt.device, attempt.task.model_devices)
    else:
        model = attempt.parallelism.wrap(
            state.model, attempt.device, attempt.task.model_devices, synced=live is not None
        )
    data = attempt.data
    sample_log = SampleLog(
        # One ledger per data-parallel rank: a tensor-parallel group trains on one share.
        cfg.sample_log if data.leader else None,
        rank=data.rank,
        world_size=data.size,
        generation=session.generation,  # fenced: strictly above every earlier attempt
    )
    scalars = Scalars(cfg.tensorboard, resume_step=resumed.step, enabled=env.is_rank0)
    loader = attempt.loader(resumed.step)
    trainer = Trainer(
        task=attempt.task,
        model=model,
        optimizer=state.optimizer,
        scheduler=state.scheduler,
        loader=loader,
        precision=precision,
        device=attempt.device,
        rank=data.rank,  # per-step seeds: one tensor-parallel group draws the same dropout
        seed=cfg.seed,
        clip_grad_norm=cfg.clip_grad_norm,
        on_share=sample_log.record,
        before_update=_update_gate(attempt, state, driver),
        check=_gradient_check(cfg, state, precision),
        skip_steps=dict.fromkeys(parse_steps(cfg.skip_steps), numerics.NAMED),
    )
    if replica is not None and replica.alone:
        left = resumed.step < cfg.max_steps
        replica.prime_alone((lambda _: trainer.prime_buckets(resumed.step)) if left else None)
    connections = attempt.groups.connections
    if cfg.replace_in_place and connections is not None:
        # Every group of the epoch is built now (mesh, tiers): its end may shut each of them.
        connections.learn(attempt.groups.control)
    # DDP's buckets primed with every rank, unless the epoch's wrapper came primed (in place).
    primes = attempt.parallelism.primes_buckets and replica is None
    skips, spikes, twins = _guards(attempt, sample_log, resumed.step)
    run = _Run(
        attempt,
        state,
        trainer,
        resumed,
        scalars,
        driver,
        primes,
        skips,
        spikes,
        twins,
        at_start=live is None,
    )
    try:
        return run.loop(startup)
    except PeerLost:
        raise  # this rank left the epoch itself (a node evicted): its state is carried
    except Exception as e:
        # Evicted: this process leaves, whatever ended the epoch meanwhile. A stream's per-rank
        # position is only gathered at checkpoints: restart.
        if isinstance(e, NodeEvictedError) or state.per_rank or not driver.is_peer_loss(e):
            raise
        raise PeerLost(run.carry(), e) from e
    finally:
        trainer.loader.close()
        scalars.close()


def _guards(
    attempt: Attempt, sample_log: SampleLog, start: int
) -> tuple[numerics.Skips, numerics.SpikeDetector, replicas.ReplicaCheck]:
    """The loop's numerical guards (``numerics``, ``replicas``): skips, spikes, twins."""
    cfg, env, session = attempt.cfg, attempt.env, attempt.session
    skips = numerics.Skips(
        limit=cfg.max_consecutive_skips,
        events=attempt.events,
        sample_log=sample_log,
        group=attempt.groups.control,
        data_rank=attempt.data.rank,
        rank=env.rank,
        committed=lambda: session.last_committed,
    )
    twins = replicas.ReplicaCheck(
        cfg.compare_replicas_every or None,
        shape=attempt.shape,
        rank=env.rank,
        world_size=env.world_size,
        group=attempt.groups.control,
        events=attempt.events,
        host=socket.gethostname(),
        start=start,
    )
    return skips, numerics.SpikeDetector(cfg.loss_spike_mads), twins


def _gradient_check(
    cfg: RunConfig, state: TrainState, precision: Precision
) -> numerics.GradientCheck | None:
    """``--skip-nonfinite``, unless fp16's GradScaler skips overflowed steps itself."""
    if not cfg.skip_nonfinite or precision.scaler is not None:
        return None
    return numerics.GradientCheck(sharded=sharded.is_sharded(state.model))


def _update_gate(attempt: Attempt, state: TrainState, driver: EpochDriver):
    """In place: what runs between the gradients' sync and the optimizer step
    (``epoch_end.update_gate``): on CUDA always; on the CPU a barrier with replicated shards
    (HSDP), none otherwise (DDP's whole state is in every survivor, and FSDP's dead shards are in
    no survivor's memory anyway)."""
    if not attempt.cfg.replace_in_place:
        return None
    twins = False
    if sharded.is_sharded(state.model):
        params = {n: p for n, p in state.model.named_parameters() if hasattr(p, "device_mesh")}
        twins = len(sharded.twins(params)) >= 2
    return epoch_end.update_gate(attempt.device, twins=twins, end=driver.epoch.end)


@dataclass
class _Run:
    """The loop's shared parts: who reports, what is trained, from where."""

    attempt: Attempt
    state: TrainState
    trainer: Trainer
    resumed: Resumed
    scalars: Scalars
    driver: EpochDriver
    collective_prime: bool
    skips: numerics.Skips
    spikes: numerics.SpikeDetector
    replicas: replicas.ReplicaCheck
    at_start: bool = False
    """Not an in-place epoch: the nodes check themselves before they train."""

    def __post_init__(self) -> None:
        cfg, env = self.attempt.cfg, self.attempt.env
        self.progress = Progress(
            world_size=env.world_size,
            start_step=self.resumed.step,
            max_steps=cfg.max_steps,
            every_s=cfg.log_every_seconds,
            events=self.attempt.events,
            enabled=env.is_rank0,
            restarts=env.restart_count,
            hosts=self.attempt.session.hosts,
            live=live_terminal(cfg.progress, sys.stderr),
        )
        self.progress.last_checkpoint = self.resumed.checkpoint_step
        self.loss = torch.zeros(())
        self.applied_loss = self.loss
        """The last applied step's loss: a report with no applied step since the last (all
        skipped, or a rollback's fresh means) shows it, never a skipped step's NaN."""
        self.completed = self.resumed.step
        """Steps whose optimizer step ran: what this rank's state holds if a peer dies now."""
        self.standing: dict[int, stragglers.Straggler] = {}
        """Rank 0: stragglers named and not recovered (``--straggler-action evict|replace``)."""
        self.refused: dict[int, str] = {}
        """Rank 0: each standing straggler's last refusal, recorded once while it holds."""
        self._first_done = False
        self.rolled_back_at: int | None = None
        """The step the last rollback was decided at (``rollback``)."""

    def carry(self) -> LiveState:
        """This rank's state for the next membership epoch (its live tensors, not copied)."""
        seen, state, step = time.time(), self.state, self.completed
        if sharded.is_sharded(state.model):
            captured, layout = live_shards.hold(state, step=step)
        else:
            captured, layout = tstate.capture(state, step=step), None
        committed = self.attempt.session.last_committed
        return LiveState(step, captured, committed, failed_seen_at=seen, layout=layout)

    def report(self, step: int, slow=None) -> list[stragglers.Straggler]:
        """Every rank (the means are one all-reduce); rank 0 logs and records, and returns the
        stragglers newly named (or recovered)."""
        means, fields = self.trainer.summary(dist.group.WORLD)
        metrics = {k: v for k, v in means.items() if k != "loss"}
        loss = means.get("loss", self.applied_loss)
        named = self.progress.report(step, loss, slow, metrics=metrics, **fields)
        self.scalars.write(step, "train", {**means, **fields})
        return named

    def _checkpoints_shown(self) -> None:
        session = self.attempt.session
        self.progress.last_checkpoint = session.last_committed
        self.progress.last_local = session.last_local

    def loop(self, startup: dict[str, float]) -> int:
        attempt, trainer, resumed = self.attempt, self.trainer, self.resumed
        cfg = attempt.cfg
        if resumed.step < cfg.max_steps:  # a stop told while this epoch formed: before a step
            attempt.session.stop_if_told(resumed.step, self.state)
        if self.at_start and cfg.self_check and resumed.step < cfg.max_steps:
            health.check_nodes(self)  # before any step: a failing node leaves now
        if resumed.step < cfg.max_steps and self.collective_prime:
            with named_timeout(
                "--collective-timeout", cfg.collective_timeout, "the first step's all-reduce"
            ):
                trainer.prime_buckets(resumed.step)
            if attempt.replica is not None:  # in place: later epochs keep it (KeptReplica)
                attempt.replica.kept(trainer.model)
        t_loop = time.monotonic()
        startup["ddp_s"] += t_loop
        self._startup, self._t_loop = startup, t_loop
        self._t_first = self._t_done = t_loop
        step = resumed.step
        while step < cfg.max_steps:
            back = self._step(step)
            if back is None:
                step += 1
                continue
            step = rollback.roll_back(self, back, step)
            if back.suspects is not None:  # who computed wrong leaves, with the agreed state
                health.leave_out_suspects(self, step, back.suspects)
        return self._finish(t_loop, self._t_first, self._t_done)

    def _step(self, step: int) -> numerics.Rollback | None:
        """Train ``step``, then what every rank agrees after it; a rollback when one is due."""
        attempt, trainer, session = self.attempt, self.trainer, self.attempt.session
        cfg, env = attempt.cfg, attempt.env
        CONTEXT.step = step
        with named_timeout("--collective-timeout", cfg.collective_timeout, f"training step {step}"):
            self.loss = trainer.step(step)
            if trainer.skipped:
                back = self.skips.record(step, trainer.skipped, trainer.indices(), self.loss)
                if back is not None:
                    return back
            else:
                self.skips.applied()
                self.spikes.add(step, self.loss)
                self.applied_loss = self.loss
            done = self.completed = step + 1
            CONTEXT.step = done
            if self.replicas.due(done):  # before any copy of this step is taken
                differ = self.replicas.compare(done, trainer.model)
                if differ is not None:
                    return numerics.Rollback(differ.agreed_at, [], replicas.DIFFER, differ.suspects)
            if self.progress.live:
                self._checkpoints_shown()
                self.progress.tick(done, self.loss)
            self._t_done = time.monotonic()
            if not self._first_done:  # how long a (re)start took to get back to training
                self._first_done, self._t_first = True, self._t_done
                self._startup["step_s"] = self._t_done - self._t_loop
                attempt.events.emit(
                    Event.FIRST_STEP,
                    step=done,
                    loss=float(self.loss.item()) if env.is_rank0 else None,
                    **{k: round(v, 4) for k, v in self._startup.items()},
                )
            if attempt.eval_due(done):
                attempt.evaluate(done, trainer.model, trainer.precision, self.scalars)
            spike = self.spikes.scan() if session.agrees_at(done) else None
            outcome = session.step(
                done,
                self.state,
                report=self.progress.due(),
                may_save=done < cfg.max_steps,
                spike_step=spike,
            )
            if outcome.spike_step is not None:
                return numerics.Rollback(outcome.spike_step, None, numerics.SPIKE)
            # The last step's report comes after the final checkpoint, once: a report agreed
            # at the last step too would record the final step twice.
            if outcome.report and done < cfg.max_steps:
                self._checkpoints_shown()
                slow = stragglers.gather(trainer.timer, attempt.groups.control)
                health.evict_if_decided(self, done, self.report(done, slow))
        return None

    def _finish(self, t_loop: float, t_first: float, t_done: float) -> int:
        """The final checkpoint, the last report and evaluation, the end of the attempt."""
        attempt, trainer, resumed = self.attempt, self.trainer, self.resumed
        cfg, session = attempt.cfg, attempt.session
        if resumed.step > cfg.max_steps:
            # Never label step-k state as an earlier step: there is nothing to train or save.
            logger.warning(
                "checkpoint is at step %d, past --max-steps %d; nothing to do",
                resumed.step,
                cfg.max_steps,
            )
        else:
            session.save(cfg.max_steps, self.state, Reason.FINAL)
        self.progress.last_checkpoint = session.last_committed
        if resumed.step < cfg.max_steps:
            self.report(cfg.max_steps)
            if attempt.task.evaluate is not None:  # the final score
                attempt.evaluate(cfg.max_steps, trainer.model, trainer.precision, self.scalars)
        self.progress.close()
        session.close()
        elapsed = time.monotonic() - t_loop
        trained = max(cfg.max_steps - resumed.step, 0)
        logger.info(
            "FINISHED %d steps (%d this attempt in %.1fs); exit 0", cfg.max_steps, trained, elapsed
        )
        # Before the end event: the run's last line is its end.
        self.driver.finish(max(cfg.max_steps, resumed.step), nodes=session.nodes)
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
