"""Numerical faults in the loop: a step whose gradient is not finite is skipped on every rank and
never applied; the steps ``--skip-steps`` names are skipped the same way. Every skip is recorded
(the sample ledger, a ``skip`` event); more than ``--max-consecutive-skips`` non-finite steps in a
row stop the job, naming the steps and the samples.

Why the gradient decides, and under DDP with no collective of its own: a non-finite loss puts
non-finite values into its rank's gradient (the backward runs through them), and DDP's all-reduce
sums every rank's gradient into every rank's, where a NaN or an infinity stays one. So every rank
reads the same verdict from its own reduced gradient. Sharded gradients (FSDP, HSDP, tensor
parallel) carry a rank's NaN into some shards only: their verdict is the clipped norm's, which is
already the whole gradient's (``--clip-grad-norm``), or one all-reduce of one number per step.

A skipped step changes no state: no optimizer or scheduler step, no ``Task.after_step``. So a run
that skipped step s is bitwise the run told ``--skip-steps s``, and N skips in a row mean N
batches failed on the same weights: the weights, not the data, are then the likely cause.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.cluster.collectives import all_gather_object
from elastictrain.errors import NumericalFaultError
from elastictrain.observe.events import Event, EventLog, SampleLog
from elastictrain.step_list import format_steps

logger = logging.getLogger(__name__)

NON_FINITE = "non-finite gradient"
NAMED = "--skip-steps"
SPIKE = "loss spike"
SPIKE_WINDOW = 100
"""Applied steps' losses a spike is judged against (this rank's, the newest)."""
SPIKE_MIN = 20
"""Losses needed before anything is judged a spike: the first steps of a run fall fast."""
SPIKE_RECORD = 2.5
"""A spike is at least this many times the window's highest loss (``SpikeDetector``)."""


class GradientCheck:
    """Whether the step's whole gradient is finite, the same answer on every rank."""

    def __init__(self, *, sharded: bool, group: Any = None) -> None:
        self.sharded = sharded and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = group

    def finite(self, model: nn.Module, grad_norm: torch.Tensor | None) -> bool:
        """``grad_norm``: the whole gradient's norm when clipping computed it (one host sync)."""
        if grad_norm is not None:
            return bool(torch.isfinite(grad_norm))
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        # The 2-norm, as clip_grad_norm_ takes it: fused kernels, 10x faster on the CPU than the
        # largest magnitude. An element past 1e19 overflows it, and is non-finite to clipping too.
        worst = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not self.sharded:
            return bool(torch.isfinite(worst))
        bad = (~torch.isfinite(worst)).to(torch.float32).reshape(1)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return not bool(bad.item())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass(frozen=True)
class Rollback:
    """Every rank goes back to the newest copy at or before ``not_after`` and skips ``window``
    (None: every step from that copy through ``not_after``)."""

    not_after: int
    window: list[int] | None
    reason: str
    """Why: ``NON_FINITE`` (more than the limit in a row), ``SPIKE`` or ``replicas.DIFFER``."""
    suspects: list | None = None
    """Replicas differed: the ``replicas.Suspect`` ranks, whose nodes leave after the rollback
    (``health.leave_out_suspects``); None for the other reasons."""

    def skip_reason(self) -> str:
        return f"rolled back: {self.reason}"


class Skips:
    """Every rank: records each skipped step (the ledger, a ``skip`` event from rank 0), counts
    the non-finite ones in a row, and past ``limit`` asks for a rollback, or stops the job when
    the fault came straight back after one."""

    def __init__(
        self,
        *,
        limit: int,
        events: EventLog,
        sample_log: SampleLog | None,
        group: Any,
        data_rank: int,
        rank: int,
        committed: Any = lambda: None,
        library: bool = False,
    ) -> None:
        """``library``: library mode's loop (``loop_guards``): its messages name its arguments,
        not the runner's flags."""
        self.limit, self.library = limit, library
        self.events, self.sample_log = events, sample_log
        self.group, self.data_rank, self.rank = group, data_rank, rank
        self.committed = committed
        self.in_a_row: list[tuple[int, list[int]]] = []
        """The non-finite steps since the last applied one: (step, its samples)."""
        self.rolled_back: list[tuple[int, list[int]]] = []
        """The run of non-finite steps the last rollback skipped: one straight after it is the
        same fault, back."""
        self.total = 0

    def applied(self) -> None:
        self.in_a_row.clear()

    def record(
        self, step: int, reason: str, indices: Sequence[int], loss: torch.Tensor | None
    ) -> Rollback | None:
        """Every rank, at the same step (the verdict is every rank's); ``loss``: this rank's
        (None: not known, library mode's ``train_step`` keeps it)."""
        t0 = time.perf_counter()
        if self.sample_log is not None:
            self.sample_log.skip(step, reason)
        loss_finite = reason != NON_FINITE or loss is None or bool(torch.isfinite(loss))
        mine = (self.rank, self.data_rank, loss_finite, list(indices))
        every = all_gather_object(mine, self.group) if self.group is not None else [mine]
        by_share = {data_rank: idx for _, data_rank, _, idx in every}  # one per tensor group
        samples = sorted(i for idx in by_share.values() for i in idx)
        bad_loss = sorted(rank for rank, _, ok, _ in every if not ok)
        self.total += 1
        if reason == NON_FINITE:
            self.in_a_row.append((step, samples))
        self.events.emit(
            Event.SKIP,
            step=step,
            reason=reason,
            loss_not_finite_on=bad_loss,
            in_a_row=len(self.in_a_row),
            samples=samples,
            seconds=round(time.perf_counter() - t0, 4),  # what the skip added to the step
        )
        if reason == NON_FINITE and self.rank == 0:
            why = f"non-finite loss on rank(s) {bad_loss}" if bad_loss else "every loss finite"
            what = f"its {len(samples)} sample(s) are recorded as skipped"
            if self.library:  # the loss and the data are train_step's
                why, what = "in train_step's backward", "the skip is recorded"
            logger.warning(
                "step %d skipped on every rank: the gradient is not finite (%s); no state "
                "changed, %s (%d in a row, at most %d)",
                step,
                why,
                what,
                len(self.in_a_row),
                self.limit,
            )
        if len(self.in_a_row) <= self.limit:
            return None
        first = self.in_a_row[0][0]
        if self.rolled_back and first == self.rolled_back[-1][0] + 1:
            raise NumericalFaultError(self._stop_message())
        steps = [s for s, _ in self.in_a_row]
        self.rolled_back, self.in_a_row = list(self.in_a_row), []
        return Rollback(not_after=first, window=steps, reason=NON_FINITE)

    def _stop_message(self) -> str:
        runs = self.rolled_back + self.in_a_row
        steps = [s for s, _ in runs]
        shown = "; ".join(f"step {s}: {_some(samples)}" for s, samples in runs[:4]) + (
            "; ..." if len(runs) > 4 else ""
        )
        return (
            f"steps {format_steps(steps)} had a non-finite loss or gradient, {len(steps)} in a "
            f"row with a rollback between (more than {self._limit_named} {self.limit} "
            f"twice): the run went back to a copy before step {steps[0]}, skipped steps "
            f"{format_steps(s for s, _ in self.rolled_back)}, and the very next batches failed "
            "again, so the fault is in the weights or the data, not a passing one. Nothing "
            f"non-finite was applied or committed (newest committed step: {self.committed()}). "
            f"{self._samples(shown)} If the data is the cause, {self._skip_them(steps)}; if "
            "the weights are, resume from an earlier checkpoint with a lower learning rate."
        )

    @property
    def _limit_named(self) -> str:
        return "max_consecutive_skips" if self.library else "--max-consecutive-skips"

    def _samples(self, shown: str) -> str:
        if self.library:  # the data is the user's: no sample ids
            return "Their batches are train_step's for those steps."
        return f"Their samples ({shown}; all of them in the event log's skip events)."

    def _skip_them(self, steps: list[int]) -> str:
        if self.library:
            return f"drop the batches of steps {format_steps(steps)} from your data"
        return f"relaunch with --skip-steps {format_steps(steps)}"


def _some(samples: list[int], n: int = 16) -> str:
    head = ", ".join(map(str, samples[:n]))
    return f"[{head}{', ...' if len(samples) > n else ''}] ({len(samples)})"


class SpikeDetector:
    """This rank's loss, judged against its last ``SPIKE_WINDOW`` applied steps. A spike is a
    loss both far above their typical value, median + ``mads`` x 1.4826 x MAD (the median
    absolute deviation scaled to a normal's standard deviation; at least 0.1% of the median),
    and ``SPIKE_RECORD`` times above the highest of them. The first is robust (one outlier moves
    neither statistic; a loss that falls as a run learns never looks high); the second keeps the
    heavy right tail of a small batch's loss from looking like one: over 4,000 steps of the toy
    at 32 samples a rank, the loss reached 15 MADs above the median, and never 1.93 times the
    window's highest. The losses stay on the device until an agreement reads them, one host
    sync each (not one a step); the agreement makes the earliest spike every rank's decision."""

    def __init__(self, mads: float | None) -> None:
        self.mads = mads
        self.history: deque[tuple[int, float]] = deque(maxlen=SPIKE_WINDOW)
        self._pending: list[tuple[int, torch.Tensor]] = []

    def add(self, step: int, loss: torch.Tensor) -> None:
        """An applied step's loss (a skipped step has none to judge)."""
        if self.mads is not None:
            self._pending.append((step, loss.detach()))

    def scan(self) -> int | None:
        """The first pending step whose loss is a spike, or None; the pending losses before it
        join the history."""
        if not self._pending:
            return None
        # One host sync for them all (the losses sit on one device).
        values = torch.stack([v.float().reshape(()) for _, v in self._pending]).tolist()
        steps = [s for s, _ in self._pending]
        self._pending.clear()
        for step, value in zip(steps, values, strict=True):
            judged = len(self.history) >= SPIKE_MIN and math.isfinite(value)
            if judged and value > self.threshold():
                return step
            self.history.append((step, value))
        return None

    def threshold(self) -> float:
        ordered = sorted(v for _, v in self.history)
        median = ordered[len(ordered) // 2]
        mad = sorted(abs(v - median) for v in ordered)[len(ordered) // 2]
        typical = median + self.mads * max(1.4826 * mad, 1e-3 * abs(median))
        return max(typical, SPIKE_RECORD * ordered[-1])

    def rolled_back(self, to_step: int) -> None:
        """The losses of the steps the rollback undid are no one's history."""
        kept = [(s, v) for s, v in self.history if s < to_step]
        self.history.clear()
        self.history.extend(kept)
        self._pending.clear()
