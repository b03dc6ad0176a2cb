"""Wires one attempt together: env -> process groups -> resume -> loop -> final checkpoint."""

from __future__ import annotations

import logging
import socket
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from elastictrain import dist as edist
from elastictrain.checkpointing import Checkpointer, CheckpointSchedule
from elastictrain.config import RunConfig
from elastictrain.data import GlobalBatchSampler
from elastictrain.env import DistEnv, read_env
from elastictrain.events import CONTEXT, EventLog, Progress, SampleLog, setup_logging
from elastictrain.loop import Trainer
from elastictrain.state import DataFingerprint
from elastictrain.task import Task, build_task

logger = logging.getLogger(__name__)


def run(cfg: RunConfig) -> int:
    env = read_env()
    setup_logging(env.rank)
    # Built before any process-group work, so a bad --task fails fast and identically everywhere.
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.task_options)
    sampler = GlobalBatchSampler(len(task.dataset), task.batch_size, cfg.seed)
    sampler.share(0, env.rank, env.world_size)  # validates world size against the batch
    fingerprint = DataFingerprint(task.batch_size, len(task.dataset), cfg.seed)

    device = edist.pick_device(env)
    t_init = time.monotonic()
    groups = edist.init_process_groups(
        env,
        device,
        init_timeout=cfg.init_timeout,
        collective_timeout=cfg.collective_timeout,
        checkpoint_timeout=cfg.checkpoint_timeout,
    )
    events = EventLog(cfg.event_log, enabled=env.is_rank0)
    logger.info(
        "started: world size %d, restart %d, generation %d, device %s, init %.2fs",
        env.world_size,
        env.restart_count,
        groups.attempt.generation,
        device,
        time.monotonic() - t_init,
    )
    events.emit(
        "start",
        world_size=env.world_size,
        restart_count=env.restart_count,
        generation=groups.attempt.generation,
        host=socket.gethostname(),
        max_steps=cfg.max_steps,
        init_s=round(time.monotonic() - t_init, 4),
    )
    try:
        return _train(cfg, env, task, sampler, fingerprint, device, groups, events)
    finally:
        edist.shutdown()


def _train(
    cfg: RunConfig,
    env: DistEnv,
    task: Task,
    sampler: GlobalBatchSampler,
    fingerprint: DataFingerprint,
    device: torch.device,
    groups: edist.ProcessGroups,
    events: EventLog,
) -> int:
    ckpt = Checkpointer(
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
        read_mode=cfg.resume_read,
    )
    ckpt.preflight()
    model = task.model.to(device)
    optimizer = task.make_optimizer(model.parameters())
    scheduler = task.make_scheduler(optimizer) if task.make_scheduler else None
    resumed = ckpt.resume(model, optimizer, scheduler, fingerprint)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    trainer = Trainer(
        task=task,
        model=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        device=device,
        rank=env.rank,
        world_size=env.world_size,
        seed=cfg.seed,
        on_share=SampleLog(
            cfg.sample_log,
            rank=env.rank,
            world_size=env.world_size,
            generation=groups.attempt.generation,
        ).record,
    )
    if resumed.step < cfg.max_steps:
        trainer.prime_buckets(resumed.step)
    schedule = CheckpointSchedule(cfg.checkpoint_every_steps, cfg.checkpoint_every_seconds)
    progress = Progress(
        world_size=env.world_size,
        start_step=resumed.step,
        max_steps=cfg.max_steps,
        every_s=cfg.log_every_seconds,
        events=events,
        enabled=env.is_rank0,
    )
    progress.last_checkpoint = resumed.checkpoint_step

    def save(step: int, reason: str) -> None:
        ckpt.save(
            step=step,
            epoch=sampler.epoch_of(max(step - 1, 0)),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            fingerprint=fingerprint,
            reason=reason,
        )
        schedule.mark_saved()
        progress.last_checkpoint = step

    loss = torch.zeros(())
    t_loop = time.monotonic()
    for step in range(resumed.step, cfg.max_steps):
        CONTEXT.step = step
        loss = trainer.step(step)
        done = step + 1
        CONTEXT.step = done
        by_time = (
            schedule.uses_time
            and edist.any_rank_flags([env.is_rank0 and schedule.due_by_time()], device)[0]
        )
        if done < cfg.max_steps and (schedule.due_by_steps(done) or by_time):
            save(done, "time" if by_time else "steps")
        progress.maybe_report(done, loss)
    if resumed.step > cfg.max_steps:
        # Never label step-k state as an earlier step: there is nothing to train or save.
        logger.warning(
            "checkpoint is at step %d, past --max-steps %d; nothing to do",
            resumed.step,
            cfg.max_steps,
        )
    else:
        save(cfg.max_steps, "final")
    if resumed.step < cfg.max_steps:
        progress.maybe_report(cfg.max_steps, loss, force=True)
    elapsed = time.monotonic() - t_loop
    trained = max(cfg.max_steps - resumed.step, 0)
    logger.info("finished %d steps (%d this attempt in %.1fs)", cfg.max_steps, trained, elapsed)
    events.emit(
        "end",
        step=max(cfg.max_steps, resumed.step),
        steps_this_attempt=trained,
        seconds=round(elapsed, 3),
    )
    return 0
