"""Deterministic, world-size-independent sampling.

Step ``s`` of the run is epoch ``s // steps_per_epoch``, and trains on slice ``s % steps_per_epoch``
of a permutation fixed by (seed, epoch). Rank r of W takes a contiguous share of that slice. The
data position is therefore just the step count, and it means the same at any world size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from elastictrain.errors import ConfigError


@dataclass(frozen=True)
class Share:
    epoch: int
    indices: torch.Tensor
    """Dataset indices this rank trains on at this step."""
    weight: float
    """Multiply the local mean loss by this so DDP's gradient average equals the global-batch mean."""


class GlobalBatchSampler:
    def __init__(self, dataset_size: int, batch_size: int, seed: int) -> None:
        if batch_size < 1 or dataset_size < batch_size:
            raise ConfigError(
                f"Need 1 <= batch_size ({batch_size}) <= dataset size ({dataset_size})."
            )
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.seed = seed
        # The tail that does not fill a global batch is dropped each epoch (a different tail each time).
        self.steps_per_epoch = dataset_size // batch_size
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(_mix(self.seed, epoch, 0x5EED))
            self._perm = torch.randperm(self.dataset_size, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, step: int) -> torch.Tensor:
        epoch, slot = divmod(step, self.steps_per_epoch)
        start = slot * self.batch_size
        return self.permutation(epoch)[start : start + self.batch_size]

    def share(self, step: int, rank: int, world_size: int) -> Share:
        if world_size > self.batch_size:
            raise ConfigError(
                f"World size {world_size} exceeds the global batch size {self.batch_size}: some ranks "
                "would get no samples. Raise the task's batch_size or run fewer ranks."
            )
        start, end = share_bounds(self.batch_size, rank, world_size)
        n = end - start
        return Share(
            epoch=self.epoch_of(step),
            indices=self.global_batch(step)[start:end],
            weight=n * world_size / self.batch_size,
        )


def share_bounds(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous [start, end) of ``rank``'s share; the first ``batch_size % world_size`` get one more."""
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _mix(*values: int) -> int:
    """A 63-bit seed from several ints (splitmix64-style), stable across Python versions."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h ^= (
            (v & 0xFFFFFFFFFFFFFFFF)
            + 0x9E3779B97F4A7C15
            + ((h << 6) & 0xFFFFFFFFFFFFFFFF)
            + (h >> 2)
        )
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed for randomness inside a step (dropout...): no per-rank RNG state needs saving."""
    return _mix(seed, step, rank)


def load_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """Seed for loading one micro-batch (augmentations in ``dataset[i]``), wherever it loads."""
    return _mix(seed, step, rank, micro, 0x10AD)


def seed_all(seed: int) -> None:
    """Seed the global generators a task may draw from: torch (CPU and every CUDA device),
    Python's ``random`` and NumPy's legacy global RNG. Generators the task creates itself
    (``np.random.default_rng()``, ``torch.Generator``) are its own to seed or checkpoint."""
    # torch.manual_seed would also visit every other backend (MPS, XPU, ...): 100+ us a call, and
    # this runs twice per step. The CPU generator plus CUDA's are the ones the runner supports.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # queued until CUDA initialises, as torch.manual_seed does
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
