"""The process-level run: env -> process groups -> checkpoint session -> the attempt's training
(``attempt`` builds it, ``training`` runs it) -> the exit code.

Exit codes (errors.py): 0 finished; 75 stopped by a signal with a checkpoint committed; 130 a
second Ctrl-C; 2 bad input; 3 init timeout; 4 hang detected; 5 a collective or checkpoint barrier
timed out; 6 the torchrun agent died (orphaned worker); 7 storage stayed down past
--storage-retry-deadline; 8 a peer or the job's store went silent (liveness); 1 a crash.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist

from elastictrain import mesh
from elastictrain.checkpoint.session import CheckpointSession, install_stop_signals
from elastictrain.cluster import self_check
from elastictrain.cluster.agents import hosts_the_store
from elastictrain.cluster.env import DistEnv, read_env
from elastictrain.cluster.groups import ProcessGroups, pick_device
from elastictrain.cluster.job_store import connect
from elastictrain.config import RunConfig
from elastictrain.errors import EXIT_INIT_TIMEOUT, EXIT_PREEMPTED, Preempted
from elastictrain.inplace import epoch_end, supervisor
from elastictrain.inplace.agreement import EpochStart
from elastictrain.inplace.driver import EpochDriver
from elastictrain.inplace.epoch import Epoch, EpochSettings
from elastictrain.inplace.members import LiveState, PeerLost
from elastictrain.inplace.spares import SpareNodes, Standby, warm_spare
from elastictrain.observe.events import LastWords
from elastictrain.observe.logs import setup_logging
from elastictrain.observe.terminal import STATUS
from elastictrain.runtime.signals import StopSignals
from elastictrain.runtime.watchdog import HangWatchdog
from elastictrain.task import Task, build_task
from elastictrain.train import parallel, streams, training
from elastictrain.train.attempt import Attempt
from elastictrain.train.data import GlobalBatchSampler
from elastictrain.train.loader import StepLoader, check_micro_steps
from elastictrain.train.loop import discarded_backward
from elastictrain.train.precision import Precision

logger = logging.getLogger(__name__)


def run(cfg: RunConfig, early_signals: StopSignals | None = None) -> int:
    """Train one attempt; the exit code. ``early_signals``: stop-signal handlers ``__main__``
    installed before importing torch, so a Ctrl-C even then is a graceful stop.

    Under ``--replace-in-place`` one attempt is a series of membership epochs in this process: a
    peer's death ends an epoch (:class:`PeerLost`, this rank's state carried), and the next one
    is built with the dead rank's replacement. A spare waits here first (``supervisor``)."""
    env = read_env()
    agent_pid = os.getppid()  # the agent, or the supervisor: recorded before any reparenting
    setup_logging(env.rank)
    # Why this process ended early, for the run report: given to everything that may end it.
    last_words = LastWords(cfg.checkpoint.event_log, env.rank)
    # Installed first: a stop signal during init or resume is remembered and honoured at step 1,
    # and a Ctrl-C there never becomes a KeyboardInterrupt traceback.
    signals = install_stop_signals(cfg.checkpoint, early_signals, last_words)
    # Built before any process-group work, so a bad --task fails fast and identically everywhere.
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.task_options)
    # Hot-spare nodes (--spare-nodes): torchrun's last nodes stand by; the rest train.
    spare_nodes = SpareNodes.of(env, cfg.spare_nodes) if cfg.spare_nodes else None
    standby = spare_nodes is not None and spare_nodes.is_spare(env.rank)
    world = spare_nodes.training_world_size if spare_nodes else env.world_size
    position = spare_nodes.position(env.rank) if spare_nodes else env.rank
    shape = mesh.resolve(cfg.parallel, cfg.mesh, world, env.local_world_size)
    # The samples are split over the data-parallel ranks: one tensor-parallel group, one share.
    data = mesh.data_ranks(shape, position, world)
    mesh.use(data)
    if streams.is_stream(task.dataset):  # no sampler: the stream says what comes next
        streams.check_stream(task.dataset, task.batch_size, data.size, cfg.grad_accum_steps)
        sampler = None
    else:
        sampler = GlobalBatchSampler(len(task.dataset), task.batch_size, cfg.seed)
        sampler.share(0, data.rank, data.size)  # validates the data-parallel size against the batch
    check_micro_steps(task.batch_size, data.size, cfg.grad_accum_steps)
    device = pick_device(env, task.model_devices)
    if cfg.replace_in_place and device.type != "cpu":
        epoch_end.refuse_unverified_nccl(device, "--replace-in-place")
    # Started before init: an orphan (agent gone) must exit even while it waits in init or resume.
    # The startup budget covers init + resume + the first step; init keeps its own hard bound.
    watchdog = HangWatchdog(
        cfg.hang_timeout,
        startup_s=cfg.init_timeout + cfg.checkpoint.checkpoint_timeout,
        floor_s=cfg.hang_floor,
        agent_pid=agent_pid if env.launched_by_torchrun else None,
        last_words=last_words,
    )
    spare = supervisor.role() == "spare"
    # Beats carry the watchdog's step and phase; the watchdog asks liveness whether a peer in a
    # gate excuses a slow step.
    driver = EpochDriver(
        env,
        device,
        epoch_settings(cfg),
        spare=spare or standby,
        spare_nodes=spare_nodes,
        watchdog=watchdog,
        step=lambda: watchdog.step,
        phase=lambda: watchdog.phase_name,
    )
    driver.attach(None, last_words)
    died_at = None
    # DDP in place: the wrapper survives the epochs with the process (parallel.KeptReplica).
    replica = parallel.KeptReplica() if cfg.replace_in_place and cfg.parallel == "ddp" else None
    if spare or standby:
        died_at = driver.wait_as_spare(
            lambda: _warm(cfg, task, sampler, device, data, replica),
            per_process=spare,
            standby=(lambda: _standby(cfg, env, device)) if standby else None,
            stop=lambda: signals.requested or os.getppid() != agent_pid,
        )
        if died_at is None:  # the supervisor is gone or ended the wait; dismissed; stopped
            return EXIT_PREEMPTED if signals.requested else 0
    watchdog.start()
    built = _Built(
        cfg, env, task, sampler, device, watchdog, signals, last_words, agent_pid, replica
    )
    carry = None
    try:
        while True:
            try:
                return _epoch(built, driver, carry, died_at)
            except PeerLost as lost:
                carry, died_at = lost.carry, None
                logger.warning(
                    "%s; this rank keeps its state at step %d and waits up to --replace-timeout "
                    "(%.0fs) for the replacement",
                    lost,
                    carry.step,
                    cfg.replace_timeout,
                )
    finally:
        STATUS.close()  # never leave a terminal on a half-drawn line
        watchdog.stop()
        driver.close()


def _warm(
    cfg: RunConfig,
    task: Task,
    sampler: GlobalBatchSampler | None,
    device: torch.device,
    data: mesh.DataRanks,
    replica: parallel.KeptReplica | None,
) -> None:
    """A spare, before it waits: what a replacement's first epoch would pay (``warm_spare``), and
    with DDP on the CPU its wrapper primed on a batch of step 0 (any step's batch gives the same
    backward order; a stream's position is not touched: it primes once called instead)."""
    warm_spare(lambda: task.make_optimizer(task.model.parameters()))
    if replica is None or sampler is None or device.type != "cpu" or task.model_devices:
        return
    loader = StepLoader(
        task=task,
        sampler=sampler,
        rank=data.rank,
        world_size=data.size,
        micro_steps=cfg.grad_accum_steps,
        seed=cfg.seed,
        start=0,
        stop=cfg.max_steps,
    )
    precision = Precision(cfg.precision, device)
    try:
        batch = loader.load_one(0)
        replica.prime_as_spare(
            task.model.to(device),
            device,
            lambda net: discarded_backward(net, batch, task, precision, device),
        )
    except Exception as e:  # an optimization only: the replacement then primes once called
        logger.warning(
            "spare for rank %d: priming DDP's buckets ahead failed (%s: %s); the replacement "
            "will prime them once called",
            data.rank,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )


def _standby(cfg: RunConfig, env: DistEnv, device: torch.device) -> Standby:
    """A spare node's rank: its place in the job's store, where a decider calls it, and its
    self-check (before it stands by, and when it is called)."""
    store = connect(env, timeout_s=cfg.init_timeout, silent_s=cfg.silent_timeout).store
    check = None
    if cfg.self_check:
        timed = store if env.local_rank == 0 else None
        check = lambda: self_check.spare_check(  # noqa: E731
            device, node=env.node_rank, store=timed, rtt_limit_s=cfg.heartbeat_seconds
        )
    return Standby(store, env.rank, check)


def epoch_settings(cfg: RunConfig) -> EpochSettings:
    """The runner's flags, as every epoch's bounds."""
    return EpochSettings(
        replace_in_place=cfg.replace_in_place,
        init_timeout=cfg.init_timeout,
        collective_timeout=cfg.collective_timeout,
        checkpoint_timeout=cfg.checkpoint.checkpoint_timeout,
        replace_wait=cfg.replace_wait,
        replace_timeout=cfg.replace_timeout,
        silent_timeout=cfg.silent_timeout,
        beat_s=cfg.heartbeat_seconds,
    )


@dataclasses.dataclass(frozen=True)
class _Built:
    """What this process built once and keeps across membership epochs."""

    cfg: RunConfig
    env: DistEnv
    task: Task
    sampler: GlobalBatchSampler | None
    device: torch.device
    watchdog: HangWatchdog
    signals: StopSignals
    last_words: LastWords
    agent_pid: int
    replica: parallel.KeptReplica | None


def _epoch(b: _Built, driver: EpochDriver, carry: LiveState | None, died_at: float | None) -> int:
    """One membership epoch: its members, process groups, checkpoint session and training.
    ``carry``: a survivor's state from the epoch before; ``died_at``: this process replaces a
    dead one. The driver moves it through its states (``inplace.states``)."""
    cfg, watchdog = b.cfg, b.watchdog
    in_place = carry is not None or died_at is not None
    t_init = time.monotonic()
    with driver.recovering(in_place):
        epoch = driver.form(carry, died_at)
        if epoch is None:
            # This rank's node is alive (this process runs), only its replacement was late (its
            # spare was still starting): torchrun's restart brings the job back to full size,
            # the others committing their step first (they stop as on a preemption).
            logger.error(
                "rank %d: the other ranks went on without this one (its replacement was not "
                "back within --replace-wait); exiting %d so torchrun restarts the group at full "
                "size",
                b.env.rank,
                EXIT_INIT_TIMEOUT,
            )
            return EXIT_INIT_TIMEOUT
        # The epoch's ranks are its members in torchrun's order: after a lost node, fewer.
        env, groups = epoch.env, epoch.groups
        setup_logging(env.rank)  # a survivor renumbered rank 0 reports as rank 0 (INFO, prefix)
        watchdog.excuse = epoch.liveness.excuse
        # A lost node takes a replica (HSDP) or shards (FSDP) with it: the mesh of what is left.
        shape = mesh.resolve(cfg.parallel, cfg.mesh, env.world_size, env.local_world_size)
        task = b.task if carry is None else _fresh_model(b)
        data = mesh.data_ranks(shape, env.rank, env.world_size)
        mesh.use(data)
        if b.sampler is not None:
            b.sampler.share(0, data.rank, data.size)  # the global batch over the new world size
        check_micro_steps(task.batch_size, data.size, cfg.grad_accum_steps)
        session = _session(b, env, groups)
        driver.attach(session.events, b.last_words)
        start = driver.agree(groups.control)
    init_s = time.monotonic() - t_init
    _say_started(b, epoch, start, shape, init_s)
    began = start.start_fields()
    if epoch.took_over:  # a spare node in a lost one's place: the size did not change
        began.update(began="taken over by a spare node in place", took_over=epoch.took_over)
    session.emit_start(
        store_here=cfg.straggler_action != "report" and hosts_the_store(b.env),
        max_steps=cfg.max_steps,
        init_s=round(init_s, 4),
        **began,
        **({"dropped_ranks": epoch.dropped} if epoch.dropped else {}),
    )
    attempt = Attempt(
        cfg, env, task, b.sampler, b.device, groups, session, watchdog, shape, b.replica
    )
    live = start.live(carry)
    try:
        code = training.train(attempt, live, driver)
    except Preempted:
        driver.fail("preempted: a stop signal, its checkpoint committed")
        return EXIT_PREEMPTED
    except PeerLost as lost:
        driver.leave(lost.carry, abandon=session.abandon)
        raise
    except BaseException as e:
        # Last words for the run report: why this attempt ended (it may also be a peer's death).
        if isinstance(e, Exception):
            session.last_words(type(e).__name__, str(e).splitlines()[0][:300])
        driver.fail(e)
        raise
    if code != 0:
        driver.fail(f"exit {code}")
    return code


def _session(b: _Built, env: DistEnv, groups: ProcessGroups) -> CheckpointSession:
    """The epoch's checkpoint session (``env``: the epoch's identity of the rank)."""
    attached = (lambda: os.getppid() == b.agent_pid) if env.launched_by_torchrun else (lambda: True)
    return CheckpointSession(
        b.cfg.checkpoint,
        env=env,
        generation=groups.attempt.generation,
        gate=groups.control,
        # The default group (nccl on GPUs), on the training device: the per-step agreement must
        # be as cheap as the step's own collectives, and time out like them.
        agree_group=dist.group.WORLD,
        agree_device=b.device,
        watchdog=b.watchdog,
        attached=attached,
        signals=b.signals,
        last_words=b.last_words,
    )


def _say_started(b: _Built, epoch: Epoch, start: EpochStart, shape, init_s: float) -> None:
    env = epoch.env
    logger.info(
        "started: world size %d%s, restart %d, generation %d, device %s, init %.2fs%s%s",
        env.world_size,
        f" (mesh {shape.describe()})" if shape else "",
        env.restart_count,
        epoch.groups.attempt.generation,
        b.device,
        init_s,
        f", replacing rank(s) {start.replaced} in place" if start.replaced else "",
        _lost(epoch),
    )


def _lost(epoch: Epoch) -> str:
    if epoch.took_over:
        pairs = ", ".join(f"{spare} for {lost}" for lost, spare in epoch.took_over)
        return f", spare node rank(s) in the lost ones' places ({pairs})"
    return f", without the lost rank(s) {epoch.dropped}" if epoch.dropped else ""


def _fresh_model(b: _Built) -> Task:
    """A survivor's task for its next epoch. DDP: the same (its model is wrapped anew). Sharded:
    built again, since FSDP2 shards a module once, over one mesh; its state is loaded from the
    survivors' shards (``checkpoint.resume.live_shards``), so the fresh initial values never
    train."""
    if b.cfg.parallel == "ddp":
        return b.task
    torch.manual_seed(b.cfg.seed)
    return build_task(b.cfg.task, b.cfg.task_options)
