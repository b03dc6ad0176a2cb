"""The decisions every rank must take at the same step, agreed with one small all-reduce.

Stop for a preemption, checkpoint because rank 0's clock says so, print progress, stop because
rank 0's background persist failed: each starts as one rank's local opinion, and a rank acting on it
alone would desynchronise the collectives. One all-reduce (MAX) of a few integers turns them into
shared decisions.

That all-reduce is not free (a measurable share of a small step: docs/measurements.md). So it runs
every ``interval_s`` seconds' worth of steps, not every step; the interval in steps is proposed by
rank 0 from its measured step time and agreed inside the same all-reduce, so every rank calls the
next one at the same step. Decisions are therefore taken at most ``interval_s`` late, far inside
torchrun's 30 s shutdown grace and any sensible checkpoint interval.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

_NO_SPIKE = -(2**31)


@dataclass(frozen=True)
class Decisions:
    stop: bool = False
    checkpoint_by_time: bool = False
    report: bool = False
    persist_failed: int = 0
    """Some rank's background persist failed for good: 1; its copy held a NaN or an infinity: 2."""
    abandoned_step: int | None = None
    """The newest step some rank gave up writing in the background (sharded checkpoints)."""
    spike_step: int | None = None
    """The earliest step some rank found a loss spike at (``train.numerics``)."""


class Control:
    def __init__(
        self,
        device: torch.device,
        *,
        is_rank0: bool,
        interval_s: float = 0.2,
        group: dist.ProcessGroup | None = None,
        alone: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``group``: the process group to agree in (None: the default one); ``alone``: a single
        process without torch.distributed, whose opinions are already the decisions; ``clock``:
        rank 0's step time is measured on it."""
        self.device = device
        self.group = group
        self.alone = alone
        self.is_rank0 = is_rank0
        self.interval_s = interval_s
        self.clock = clock
        self._next = 0  # the first completed step agrees at once
        self._last: tuple[int, float] | None = None

    def agree(
        self,
        done: int,
        *,
        stop: bool,
        by_time: bool,
        report: bool,
        persist_failed: int,
        abandoned_step: int | None = None,
        spike_step: int | None = None,
    ) -> Decisions:
        """Called by every rank after every step; collective only at agreed steps."""
        if self.alone:  # no collective to amortise: the opinions are the decisions, every step
            return Decisions(stop, by_time, report, persist_failed, abandoned_step, spike_step)
        if not self.due(done):
            return Decisions()
        proposal = 1
        now = self.clock()
        if self.is_rank0 and self._last is not None and done > self._last[0]:
            per_step = (now - self._last[1]) / (done - self._last[0])
            proposal = min(max(math.ceil(self.interval_s / max(per_step, 1e-6)), 1), 1000)
        self._last = (done, now)
        abandoned = -1 if abandoned_step is None else abandoned_step
        # The earliest spike wins: MAX of the negated step (none: the least int32).
        spike = _NO_SPIKE if spike_step is None else -spike_step
        values = [int(stop), int(by_time), int(report), int(persist_failed), proposal, abandoned]
        t = torch.tensor([*values, spike], dtype=torch.int32, device=self.device)
        if not self.alone:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        agreed = t.tolist()
        self._next = done + agreed[4]
        return Decisions(
            *(bool(v) for v in agreed[:3]),
            agreed[3],
            agreed[5] if agreed[5] >= 0 else None,
            -agreed[6] if agreed[6] != _NO_SPIKE else None,
        )

    def restart_at(self, done: int) -> None:
        """Every rank, after a rollback to ``done``: the next agreement is at once (the cadence
        counted on from steps the rollback undid), and the step time is measured anew."""
        self._next, self._last = done, None

    def due(self, done: int) -> bool:
        """Whether :meth:`agree` all-reduces at ``done`` (every step when alone)."""
        return self.alone or done >= self._next
