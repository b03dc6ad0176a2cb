"""One optimizer step at a time: micro-batches, per-step seeding, precision, clipping. No I/O."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastictrain import knobs
from elastictrain.observe.metrics import RunningMeans, split_loss
from elastictrain.observe.stragglers import StepTimer
from elastictrain.task import Task
from elastictrain.train import parallel, replicas
from elastictrain.train.data import Share, seed_all, step_seed
from elastictrain.train.loader import StepLoader
from elastictrain.train.numerics import NON_FINITE, GradientCheck
from elastictrain.train.precision import Precision


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def discarded_backward(
    net: nn.Module, batch: Any, task: Task, precision: Precision, device: torch.device
) -> None:
    """One forward and backward of ``batch`` through ``net``, in eval mode (dropout off, BatchNorm's
    statistics untouched), its gradients then dropped: DDP's bucket priming."""
    was_training = net.training
    net.eval()
    try:
        with precision.autocast():
            loss, _ = split_loss(task.loss_fn(net, to_device(batch, device)))
        loss.backward()
    finally:
        for p in net.parameters():
            p.grad = None
        net.train(was_training)


class Trainer:
    """Trains one optimizer step at a time: its micro-batches (DDP syncs only on the last), the
    run's precision, optional clipping, then the optimizer and scheduler steps."""

    def __init__(
        self,
        *,
        task: Task,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loader: StepLoader,
        precision: Precision,
        device: torch.device,
        rank: int,
        seed: int,
        clip_grad_norm: float | None = None,
        on_share: Callable[[int, int, Share], None] | None = None,
        before_update: Callable[[], None] | None = None,
        check: GradientCheck | None = None,
        skip_steps: dict[int, str] | None = None,
    ) -> None:
        self.task = task
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loader = loader
        self.precision = precision
        self.device = device
        self.rank = rank
        self.seed = seed
        self.clip_grad_norm = clip_grad_norm
        self.on_share = on_share
        """Called with (step, micro, share) before any collective: a hook for the sample ledger."""
        self.before_update = before_update
        """Called once every gradient is synced, before the optimizer changes anything: in-place
        recovery's gate, so a death mid-step leaves every rank's state at the same step."""
        self.check = check
        """Whether the step's whole gradient is finite (``numerics``); None: not checked (fp16's
        GradScaler skips overflowed steps itself)."""
        self.skip_steps = dict(skip_steps or {})
        """Steps drawn and not trained (``--skip-steps``, a rollback's window): step -> why."""
        self.skipped: str | None = None
        """Why the last step was not applied (``numerics.NON_FINITE`` or ``NAMED``), or None."""
        self.shares: list[Share] = []
        """The last step's shares of the global batch (this rank's samples)."""
        # chaos --fault nan|spike: this rank's loss goes NaN, or 30x, at those steps.
        self._nan_steps, self._spike_steps = knobs.nan_steps(), knobs.spike_steps()
        self._flip_steps = knobs.bitflip_steps()  # chaos --fault bitflip: once in a process
        self.timer = StepTimer()
        self.means = RunningMeans(device)
        self.grad_norm: torch.Tensor | None = None
        """The last step's total gradient norm before clipping (with ``clip_grad_norm``)."""
        self.overflow_skips = 0
        """fp16 steps the scaler skipped, counted at each :meth:`summary`."""
        self._last_means: dict[str, float] = {}

    def prime_buckets(self, step: int) -> None:
        """Run one discarded forward/backward so DDP rebuilds its gradient buckets now.

        DDP reorders its buckets after the first backward of each process lifetime. With more than
        two ranks the position of a gradient in the bucket decides the order gloo sums it in, so a
        resumed attempt would reduce its first step in another order than an uninterrupted run and
        lose bitwise equality. Priming at every start makes every real step use the rebuilt layout.
        Eval mode keeps BatchNorm statistics untouched; the gradients are thrown away (a GradScaler
        is not touched: its state changes only in ``update``).
        """
        batch = self.loader.load_one(step)
        discarded_backward(self.model, batch, self.task, self.precision, self.device)

    def step(self, step: int) -> torch.Tensor:
        """Train global step ``step`` (0-based); returns this rank's mean loss (not synced)."""
        t0 = time.perf_counter()
        pieces = self.loader.next_step(step)
        if self.on_share is not None:
            # Before the collective: if any rank finished this step, every rank recorded it.
            for micro, (share, _) in enumerate(pieces):
                self.on_share(step, micro, share)
        self.shares = [share for share, _ in pieces]
        self.skipped = self.skip_steps.get(step)
        if self.skipped:  # drawn, recorded, not trained: every rank alike, no collective
            return torch.full((), math.nan)
        # Randomness inside a step depends only on (seed, step, rank): nothing to checkpoint.
        # Seeded after loading, so in-process loading draws from its own seed, as workers do.
        seed_all(step_seed(self.seed, step, self.rank))
        self.optimizer.zero_grad(set_to_none=True)
        total, seen = self._backward(step, pieces, t0)
        if self.clip_grad_norm is not None:
            self.precision.unscale(self.optimizer)
            self.grad_norm = parallel.full(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
            )
        clipped = self.grad_norm if self.clip_grad_norm is not None else None
        if self.check is not None and not self.check.finite(self.model, clipped):
            self.skipped = NON_FINITE
        if self.before_update is not None:
            self.before_update()
        if self.skipped:  # never applied: no optimizer, scheduler or after_step (numerics)
            self.optimizer.zero_grad(set_to_none=True)
            return total
        for loss, metrics, n in seen:
            self.means.add(loss, metrics, n)
        self.precision.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.task.after_step is not None:
            self.task.after_step(step + 1, getattr(self.model, "module", self.model))
        if step in self._flip_steps:
            self._flip_steps = frozenset()
            replicas.flip_a_bit(self.model)
        return total

    def indices(self) -> list[int]:
        """The dataset indices of this rank's samples in the last step."""
        return [int(i) for share in self.shares for i in share.indices]

    def _backward(self, step: int, pieces: list, t0: float) -> tuple[torch.Tensor, list]:
        """Every micro-batch's forward and backward: (this rank's mean loss, each micro-batch's
        (loss, metrics, samples), counted in the means once the step is applied)."""
        samples = sum(len(share.indices) for share, _ in pieces)
        total = torch.zeros((), device=self.device)
        seen = []
        for micro, (share, batch) in enumerate(pieces):
            last = micro == len(pieces) - 1
            # Gradients are reduced in the backward of the last micro-batch only (DDP's all-reduce,
            # FSDP's reduce-scatter); the others accumulate.
            sync = contextlib.nullcontext() if last else parallel.no_sync(self.model)
            with sync:
                with self.precision.autocast():
                    loss, metrics = split_loss(
                        self.task.loss_fn(self.model, to_device(batch, self.device))
                    )
                if last and step in self._nan_steps:
                    loss = loss * math.nan
                if last and step in self._spike_steps:
                    loss = loss * knobs.SPIKE_FACTOR
                n = len(share.indices)
                seen.append((loss.detach(), metrics, n))
                total = total + loss.detach().float().to(self.device) * (n / samples)
                if last:
                    # Work before the first synchronisation (the all-reduce inside the last
                    # backward): the straggler signal.
                    self.timer.add(time.perf_counter() - t0)
                # DDP averages gradients over ranks; the weight makes that the global-batch mean.
                self.precision.backward(loss * share.weight if share.weight != 1.0 else loss)
        return total, seen

    def summary(self, group: Any) -> tuple[dict[str, float], dict[str, Any]]:
        """Every rank, at an agreed report: (the loss and task metrics averaged over samples and
        ranks since the last report, in one all-reduce; the grad norm and fp16 skips)."""
        means = self.means.reduce(group) or self._last_means  # nothing new: repeat the last
        self._last_means = means
        fields: dict[str, Any] = {}
        if self.grad_norm is not None:
            fields["grad_norm"] = round(float(self.grad_norm), 6)
        if self.precision.scaler is not None:
            fields["overflow_skips"] = self.precision.take_skips()
            self.overflow_skips += fields["overflow_skips"]
        return means, fields
