"""Building one attempt from the task: the training state (the model placed for ``--parallel``,
the optimizer, the scheduler, the task's extra state), the data loader at a step (this rank's
data-parallel share), evaluation."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from elastictrain.checkpoint.session import CheckpointSession
from elastictrain.checkpoint.state import DataFingerprint, TrainState, check_plain, unwrap
from elastictrain.cluster.env import DistEnv
from elastictrain.cluster.groups import ProcessGroups
from elastictrain.config import RunConfig
from elastictrain.errors import named_timeout
from elastictrain.mesh import MeshShape, data_ranks
from elastictrain.observe.events import Event
from elastictrain.observe.metrics import evaluate
from elastictrain.observe.tensorboard import Scalars
from elastictrain.runtime.watchdog import HangWatchdog
from elastictrain.task import Task
from elastictrain.train import parallel, streams
from elastictrain.train.data import GlobalBatchSampler
from elastictrain.train.loader import StepLoader, worker_init
from elastictrain.train.precision import Precision

logger = logging.getLogger(__name__)


class Attempt:
    """What one attempt trains with, built from the task: its state, its loader, evaluation."""

    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv,
        task: Task,
        sampler: GlobalBatchSampler | None,
        device: torch.device,
        groups: ProcessGroups,
        session: CheckpointSession,
        watchdog: HangWatchdog,
        shape: MeshShape | None = None,
        replica: parallel.KeptReplica | None = None,
    ) -> None:
        """``shape``: the resolved ``--mesh`` (None for DDP); it decides the data-parallel ranks.
        ``replica``: DDP in place, the process's wrapper kept across its epochs."""
        self.cfg, self.env, self.task, self.sampler, self.device = cfg, env, task, sampler, device
        self.groups, self.session, self.events = groups, session, session.events
        self.watchdog = watchdog
        self.shape = shape
        self.parallelism = parallel.for_setting(cfg.parallel, shape)
        self.replica = replica
        self.data = data_ranks(shape, env.rank, env.world_size)
        self.stream = (
            streams.StreamLoader(
                dataset=task.dataset,
                batch_size=task.batch_size,
                rank=self.data.rank,
                world_size=self.data.size,
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

    def build_state(self, precision: Precision) -> TrainState:
        # A model-parallel task placed its own layers; otherwise the whole model goes here.
        model = self.task.model if self.task.model_devices else self.task.model.to(self.device)
        # Before the optimizer: under FSDP it steps the local shards.
        self.parallelism.place(model, self.task.shard, self.device, self.env.world_size)
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

    def loader(self, start: int) -> StepLoader | streams.StreamLoader:
        cfg = self.cfg
        if self.stream is not None:
            self.stream.start(start)
            return self.stream
        return StepLoader(
            task=self.task,
            sampler=self.sampler,
            rank=self.data.rank,
            world_size=self.data.size,
            micro_steps=cfg.grad_accum_steps,
            seed=cfg.seed,
            start=start,
            stop=cfg.max_steps,
            num_workers=cfg.num_workers,
            prefetch_factor=cfg.prefetch_factor,
            pin_memory=self.device.type == "cuda",
            waiting=self._waiting,
        )

    def evaluate(
        self, step: int, model: torch.nn.Module, precision: Precision, scalars: Scalars
    ) -> None:
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
            scalars.write(step, "eval", metrics)

    def eval_due(self, done: int) -> bool:
        every = self.cfg.eval_every_steps
        # The last step's eval runs after the final checkpoint instead.
        return (
            self.task.evaluate is not None
            and every is not None
            and done % every == 0
            and done < self.cfg.max_steps
        )
