"""The Task API a user implements. The runner owns devices, DDP, sampling, seeding, the loop,
checkpoints and resume; a Task only says *what* to train.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from elastictrain.errors import ConfigError, TaskLoadError


@dataclass(kw_only=True)
class Task:
    """What to train.

    ``loss_fn(model, batch)`` returns the **mean** loss over the samples of ``batch`` (PyTorch's
    default reduction). The runner rescales it so the gradient equals the mean over the whole
    global batch, whatever the world size.
    """

    model: nn.Module
    """Built on the CPU; the runner moves it to this rank's device and wraps it in DDP."""
    dataset: Dataset
    """Map-style: ``len(dataset)`` and ``dataset[i]``. Must be identical on every rank."""
    batch_size: int
    """Global batch: samples per optimizer step across all ranks. Constant when ranks come and go."""
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    """Optional LR scheduler factory; stepped once per optimizer step."""
    collate_fn: Callable[[list[Any]], Any] = default_collate
    model_devices: Sequence[torch.device] | None = None
    """Model parallel: the devices the task already spread the model over (two GPUs per process,
    say). The runner then leaves placement alone, wraps DDP with ``device_ids=None`` and sends each
    batch to the first of them. Default: the runner places the model on ``cuda:LOCAL_RANK`` or CPU."""

    def __post_init__(self) -> None:
        if self.model_devices is not None:
            if not self.model_devices:
                raise ConfigError("Task.model_devices is empty; leave it None for one device.")
            self.model_devices = [torch.device(d) for d in self.model_devices]
        if not isinstance(self.model, nn.Module):
            raise ConfigError(
                f"Task.model must be a torch.nn.Module, got {type(self.model).__name__}."
            )
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"Task.batch_size must be a positive int, got {self.batch_size!r}.")
        if len(self.dataset) < self.batch_size:
            raise ConfigError(
                f"Task.dataset has {len(self.dataset)} samples, fewer than one global batch "
                f"({self.batch_size}); lower batch_size or grow the dataset."
            )


TaskFactory = Callable[[Mapping[str, str]], Task]


def load_task_factory(spec: str) -> TaskFactory:
    """Import ``MODULE:CALLABLE``; errors name the spec and the fix."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TaskLoadError(f"--task must be MODULE:CALLABLE, got {spec!r}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskLoadError(
            f"--task {spec!r}: cannot import module {module_name!r} ({e}). Check the name, and that "
            "it is importable from the launch directory (PYTHONPATH)."
        ) from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskLoadError(f"--task {spec!r}: module {module_name!r} has no callable {attr!r}.")
    return factory


def build_task(spec: str, options: Mapping[str, str]) -> Task:
    task = load_task_factory(spec)(dict(options))
    if not isinstance(task, Task):
        raise TaskLoadError(
            f"--task {spec!r} returned {type(task).__name__}, expected elastictrain.Task."
        )
    return task


def option(options: Mapping[str, str], name: str, default: Any, kind: type = int) -> Any:
    """Parse one ``--task-option``; a bad value names the option and what was expected."""
    if name not in options:
        return default
    try:
        return kind(options[name])
    except ValueError as e:
        raise ConfigError(
            f"--task-option {name}={options[name]!r} is not a valid {kind.__name__}."
        ) from e
