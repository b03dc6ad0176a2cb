"""One optimizer step at a time: sampling, per-step seeding, forward/backward/step. No I/O."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastictrain.data import GlobalBatchSampler, Share, step_seed
from elastictrain.observe.stragglers import StepTimer
from elastictrain.task import Task


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class Trainer:
    def __init__(
        self,
        *,
        task: Task,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        sampler: GlobalBatchSampler,
        device: torch.device,
        rank: int,
        world_size: int,
        seed: int,
        on_share: Callable[[int, Share], None] | None = None,
    ) -> None:
        self.task = task
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.on_share = on_share
        self.timer = StepTimer()
        """Called with each step's share before any collective: a hook for the sample ledger."""

    def prime_buckets(self, step: int) -> None:
        """Run one discarded forward/backward so DDP rebuilds its gradient buckets now.

        DDP reorders its buckets after the first backward of each process lifetime. With more than
        two ranks the position of a gradient in the bucket decides the order gloo sums it in, so a
        resumed attempt would reduce its first step in another order than an uninterrupted run and
        lose bitwise equality. Priming at every start makes every real step use the rebuilt layout.
        Eval mode keeps BatchNorm statistics untouched; the gradients are thrown away.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            batch, _ = self._batch(step)
            self.task.loss_fn(self.model, batch).backward()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.train(was_training)

    def _batch(self, step: int):
        share = self.sampler.share(step, self.rank, self.world_size)
        batch = self.task.collate_fn([self.task.dataset[i] for i in share.indices.tolist()])
        return to_device(batch, self.device), share

    def step(self, step: int) -> torch.Tensor:
        """Train global step ``step`` (0-based); returns this rank's weighted loss (not synced)."""
        t0 = time.perf_counter()
        # Randomness inside a step depends only on (seed, step, rank): nothing to checkpoint.
        torch.manual_seed(step_seed(self.seed, step, self.rank))
        batch, share = self._batch(step)
        if self.on_share is not None:
            # Before the collective: if any rank finished this step, every rank recorded it.
            self.on_share(step, share)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss_fn(self.model, batch)
        # Work before the first synchronisation (the all-reduce inside backward): the straggler signal.
        self.timer.add(time.perf_counter() - t0)
        # DDP averages gradients over ranks; the weight turns that into the global-batch mean.
        weighted = loss * share.weight if share.weight != 1.0 else loss
        weighted.backward()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss.detach()
