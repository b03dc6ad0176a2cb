"""Per-rank step-time statistics, so a slow node can be told from a hung one.

Each rank times its own work before the step's first synchronisation (data + forward). In DDP the
gradient all-reduce inside backward makes every rank *finish* together, so only the time before it
shows who the others waited on.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import torch
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
                {"rank": r, "median_s": round(m, 5), "p95_s": round(p, 5)}
                for r, (m, p) in enumerate(zip(self.medians, self.p95s, strict=True))
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
    median, p95 = timer.stats()
    mine = torch.tensor([median, p95], dtype=torch.float64)
    world = dist.get_world_size(group)
    everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return StragglerReport(
        medians=[float(t[0]) for t in everyone], p95s=[float(t[1]) for t in everyone]
    )
