"""Per-rank step-time statistics, so a slow node can be told from a hung one.

Each rank times its own work before the step's first synchronisation (data + forward). In DDP the
gradient all-reduce inside backward makes every rank *finish* together, so only the time before it
shows who the others waited on.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


class StepTimer:
    def __init__(self, window: int = 200) -> None:
        self._samples: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)

    def stats(self) -> tuple[float, float]:
        """(median, p95) of the window; zeros before the first step."""
        if not self._samples:
            return 0.0, 0.0
        ordered = sorted(self._samples)
        p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
        return statistics.median(ordered), p95


@dataclass(frozen=True)
class StragglerReport:
    medians: list[float]
    p95s: list[float]

    @property
    def slowest_rank(self) -> int:
        return max(range(len(self.medians)), key=lambda r: self.medians[r])

    @property
    def wait_s(self) -> float:
        """How much longer per step the slowest rank takes than the median of the others."""
        others = [m for r, m in enumerate(self.medians) if r != self.slowest_rank]
        return self.medians[self.slowest_rank] - statistics.median(others) if others else 0.0

    def as_event(self) -> dict:
        return {
            "ranks": [
                {"rank": r, "median_s": round(m, 5), "p95_s": round(p, 5), "score": round(s, 3)}
                for r, (m, p, s) in enumerate(
                    zip(self.medians, self.p95s, scores(self.medians), strict=True)
                )
            ],
            "slowest_rank": self.slowest_rank,
            "wait_s": round(self.wait_s, 5),
        }

    def describe(self) -> str:
        per_rank = ", ".join(
            f"r{r} {m * 1e3:.1f}/{p * 1e3:.1f}ms"
            for r, (m, p) in enumerate(zip(self.medians, self.p95s, strict=True))
        )
        return (
            f"step time median/p95 per rank: {per_rank}; slowest rank {self.slowest_rank} "
            f"(others wait ~{self.wait_s * 1e3:.1f}ms per step on it)"
        )


def gather(timer: StepTimer, group: dist.ProcessGroup) -> StragglerReport:
    """Collective over ``group``: every rank must call it at the same step."""
    import torch  # here: the report draws this module's thresholds without importing torch
    import torch.distributed as dist

    median, p95 = timer.stats()
    mine = torch.tensor([median, p95], dtype=torch.float64)
    world = dist.get_world_size(group)
    everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return StragglerReport(
        medians=[float(t[0]) for t in everyone], p95s=[float(t[1]) for t in everyone]
    )


SLOW_RATIO = 1.3
"""A rank is slow at a report when its median work before the first synchronisation is at least
this many times the others' median: a straggler costs the job 30% of a step or more. Below it,
ranks differ by their data (a long batch, a short one) as much as by their hardware."""
SLOW_REPORTS = 3
"""...at this many reports in a row (at the default 10 s a report, 30 s) before it is named: each
report's median is over the last 200 steps already, so a pause of a few steps cannot move it,
and a rank slowed for one report (a checkpoint's write, a compaction) is not named either."""
SLOW_FLOOR_S = 0.002
"""...and by at least this much a step: under it a ratio is timer noise (a 0.3 ms step against
0.2 ms), not a cost anyone would act on."""


@dataclass(frozen=True)
class Straggler:
    """A rank named slow (``slow``) or no longer slow, with the evidence it was judged on."""

    rank: int
    host: str | None
    slow: bool
    ratio: float
    """Its median over the others' median (1.0: as fast as the job)."""
    median_s: float
    others_s: float
    reports: int
    """How many reports in a row it was slow (0 when it recovered)."""

    def as_event(self) -> dict:
        return {
            "rank": self.rank,
            "host": self.host,
            "slow": self.slow,
            "ratio": round(self.ratio, 3),
            "median_s": round(self.median_s, 5),
            "others_s": round(self.others_s, 5),
            "reports": self.reports,
        }

    def cause(self) -> str | None:
        """Why its node would be evicted (``inplace.eviction``); None once it recovered."""
        if not self.slow:
            return None
        return (
            f"is a straggler: rank {self.rank} took {self.ratio:.2f}x the others' work before "
            f"each step's first synchronisation for {self.reports} reports in a row"
        )

    def describe(self) -> str:
        where = f"rank {self.rank}" + (f" on host {self.host}" if self.host else "")
        if not self.slow:
            return f"{where} is no longer a straggler ({self.ratio:.2f}x the others' step work)"
        return (
            f"STRAGGLER: {where} takes {self.ratio:.2f}x the others' work before each step's "
            f"first synchronisation ({self.median_s * 1e3:.1f} against "
            f"{self.others_s * 1e3:.1f} ms, medians), {self.reports} reports in a row; every "
            "rank waits on it"
        )


def scores(medians: list[float]) -> list[float]:
    """Each rank's median over the median of the others' (1.0 for a single rank). Against the
    others, not the job: at 2 ranks the job's median moves halfway to the slow one."""
    out = []
    for r, mine in enumerate(medians):
        others = medians[:r] + medians[r + 1 :]
        base = statistics.median(others) if others else mine
        out.append(mine / base if base > 0 else 1.0)
    return out


class StragglerWatch:
    """Rank 0: which ranks are persistently slower than the others (:data:`SLOW_RATIO`,
    :data:`SLOW_REPORTS`, :data:`SLOW_FLOOR_S`). Fed each periodic :class:`StragglerReport`; says
    only what changed, so a straggler is named once, and once more when it recovers. A job-wide
    slowdown moves every rank's median and the others' with it: no one is named."""

    def __init__(
        self,
        hosts: list[str] | None = None,
        *,
        ratio: float = SLOW_RATIO,
        reports: int = SLOW_REPORTS,
        floor_s: float = SLOW_FLOOR_S,
    ) -> None:
        self.hosts = hosts
        self.ratio, self.reports, self.floor_s = ratio, reports, floor_s
        self._streak: dict[int, int] = {}
        self._named: set[int] = set()

    def update(self, report: StragglerReport) -> list[Straggler]:
        changed = []
        for rank, (median, score) in enumerate(
            zip(report.medians, scores(report.medians), strict=True)
        ):
            others = median / score if score > 0 else median
            slow = score >= self.ratio and median - others >= self.floor_s
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            named = rank in self._named
            if slow and not named and self._streak[rank] >= self.reports:
                self._named.add(rank)
            elif not slow and named:
                self._named.discard(rank)
            else:
                continue
            host = self.hosts[rank] if self.hosts and rank < len(self.hosts) else None
            changed.append(Straggler(rank, host, slow, score, median, others, self._streak[rank]))
        return changed
