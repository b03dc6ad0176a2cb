"""Training metrics averaged across ranks at the progress cadence, and the evaluation hook.

A ``loss_fn`` may return ``(loss, {"name": value})``. Each rank keeps sample-weighted sums on its
device (no host sync per step); when a progress report is due, one all-reduce turns them into the
global means since the last report. ``Task.evaluate`` runs on every rank (see :func:`evaluate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.errors import ConfigError


def split_loss(out: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """``loss_fn``'s result as (loss, metrics)."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise ConfigError(
                "Task.loss_fn must return a loss tensor or (loss, {name: value}); got a tuple "
                f"of {len(out)} items."
            )
        return out[0], out[1]
    return out, {}


class RunningMeans:
    """Sample-weighted sums of the loss and the task's metrics since the last report.

    Tensor values are summed where they live and Python numbers on the host, so a step never
    waits for the device (building a CUDA tensor from a Python number would be a host sync).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        """``device``: where the sums are all-reduced (the rank's device; a model-parallel loss
        may come from another of its devices)."""
        self.device = device
        self.names: tuple[str, ...] | None = None
        self._sums: dict[str, Any] = {}
        self._samples = 0

    def add(self, loss: torch.Tensor, metrics: Mapping[str, Any], samples: int) -> None:
        names = tuple(sorted(metrics))
        if self.names is None:
            self.names = names
        elif names != self.names:
            raise ConfigError(
                f"Task.loss_fn returned metrics {list(names)} after {list(self.names)}: every "
                "step must return the same names (they are averaged across ranks)."
            )
        for name, value in (("loss", loss), *((n, metrics[n]) for n in names)):
            if isinstance(value, torch.Tensor):
                value = value.detach().float().reshape(()) * samples
            else:
                value = float(value) * samples
            self._sums[name] = self._sums[name] + value if name in self._sums else value
        self._samples += samples

    def reduce(self, group: dist.ProcessGroup | None) -> dict[str, float] | None:
        """Every rank: the global means since the last call (one all-reduce), or None if no step
        ran since. Every rank must call it at the same step, as with any collective."""
        if not self._samples:
            return None
        names = ("loss", *self.names)
        device = self.device or next(
            (v.device for v in self._sums.values() if isinstance(v, torch.Tensor)), None
        )
        sums = torch.stack(
            [torch.as_tensor(self._sums[n], device=device).float() for n in names]
            + [torch.tensor(float(self._samples), device=device)]
        )
        self._sums, self._samples = {}, 0
        if dist.is_initialized():
            dist.all_reduce(sums, group=group)
        values = (sums[:-1] / sums[-1]).tolist()
        return dict(zip(names, values, strict=True))


def evaluate(
    fn: Callable[[nn.Module], Mapping[str, Any]],
    model: nn.Module,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    group: dist.ProcessGroup | None,
) -> dict[str, float]:
    """Run ``Task.evaluate`` on every rank and average each metric over the ranks.

    Every rank runs it, so nobody idles at the next collective while one rank evaluates, and a
    task that ignores sharding still gets the exact value (each rank computes the same one). A task
    with a large eval set shards it with :func:`elastictrain.eval_shard`; the ranks' means are then
    averaged with equal weights (exact when the shards are equal). Eval mode, no gradients, the
    run's precision; train mode is restored after.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            local = {str(k): float(v) for k, v in fn(model).items()}
    finally:
        model.train(was_training)
    if not dist.is_initialized():
        return local
    everyone: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, local, group=group)
    if any(set(r) != set(local) for r in everyone):
        raise ConfigError(
            f"Task.evaluate returned different metric names on different ranks: {everyone}"
        )
    return {k: sum(r[k] for r in everyone) / len(everyone) for k in sorted(local)}
