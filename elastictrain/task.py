"""The Task API a user implements. The runner owns devices, DDP, sampling, seeding, the loop,
checkpoints and resume; a Task only says *what* to train.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from elastictrain import mesh
from elastictrain.errors import ConfigError, TaskLoadError


@dataclass(kw_only=True)
class Task:
    """What to train.

    ``loss_fn(model, batch)`` returns the **mean** loss over the samples of ``batch`` (PyTorch's
    default reduction), or ``(loss, {"name": value})`` to log metrics beside it. The runner
    rescales the loss so the gradient equals the mean over the whole global batch, whatever the
    world size and ``--grad-accum-steps``. It runs under ``torch.autocast`` with ``--precision
    bf16|fp16``, and after the per-step seeding of torch, ``random`` and NumPy.
    """

    model: nn.Module
    """Built on the CPU; the runner moves it to this rank's device and wraps it in DDP."""
    dataset: Dataset
    """Map-style: ``len(dataset)`` and ``dataset[i]``, identical on every rank. Or a stream, an
    ``IterableDataset`` with ``state_dict()``/``load_state_dict()`` (and ``seek(position, rank,
    world_size)`` to resume at another world size): see :mod:`elastictrain.train.streams`."""
    batch_size: int
    """Global batch: samples per optimizer step across all ranks. Constant when ranks come and go."""
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor | tuple[torch.Tensor, Mapping[str, Any]]]
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    """Optional LR scheduler factory; stepped once per optimizer step."""
    collate_fn: Callable[[list[Any]], Any] = default_collate
    state: Mapping[str, Any] = field(default_factory=dict)
    """Extra state checkpointed with the model: name -> an object with ``state_dict()`` and
    ``load_state_dict()`` (DCP's ``Stateful`` shape), e.g. an EMA of the weights or a token
    counter. Its state_dict may hold tensors, numbers, strings and dicts/lists of them; the names
    must match the checkpoint's on resume."""
    after_step: Callable[[int, nn.Module], None] | None = None
    """``after_step(done, model)``: called on every rank after each optimizer step with the count
    of completed steps and the unwrapped model; update an EMA or a counter in ``state`` here.
    (``loss_fn`` is also called once, discarded, at every start to prime DDP: keep side effects
    out of it.)"""
    evaluate: Callable[[nn.Module], Mapping[str, Any]] | None = None
    """``evaluate(model) -> {"name": value}``, run every ``--eval-every-steps`` on every rank in
    eval mode under ``torch.no_grad``; the ranks' results are averaged. Shard a large eval set
    with :func:`eval_shard`. With ``--parallel fsdp`` every forward gathers parameters from all
    ranks, so every rank must call the model the same number of times."""
    shard: Callable[[nn.Module, Any], None] | None = None
    """``shard(model, mesh)`` with ``--parallel fsdp|hsdp``: apply ``fully_shard`` to the units you
    choose (transformer blocks, say), then to the root; called on every rank, before the optimizer
    is built, with the runner's named device mesh: ``dp_shard`` (1-D over all ranks by default),
    with ``dp_replicate`` for HSDP and ``tp`` with ``--mesh tp=N`` (apply the tensor-parallel plan
    over ``mesh["tp"]``, then shard over ``elastictrain.mesh.data_mesh(mesh)``; docs/layouts.md).
    Re-create here any ``state`` that mirrors the parameters (an EMA), so it is sharded like them.
    Default: each child module that has parameters, then the root. A layout the runner was not
    told about (tensor parallelism without ``--mesh tp=N``) is refused at start (exit 2)."""
    hf_config: Mapping[str, Any] | None = None
    """The model's Hugging Face config as a dict (``model.config.to_dict()``): saved with every
    checkpoint, and written as ``config.json`` by ``export -o FOLDER`` unless ``--config`` is
    given, so ``from_pretrained`` loads the folder as it is."""
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
        for name, obj in self.state.items():
            if not isinstance(name, str) or not all(
                callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")
            ):
                raise ConfigError(
                    f"Task.state[{name!r}] is a {type(obj).__name__}: each entry needs a str name "
                    "and state_dict() and load_state_dict() methods."
                )
        if isinstance(self.dataset, IterableDataset):
            return  # a stream: checked by the runner (streams.check_stream), which knows the ranks
        if len(self.dataset) < self.batch_size:
            raise ConfigError(
                f"Task.dataset has {len(self.dataset)} samples, fewer than one global batch "
                f"({self.batch_size}); lower batch_size or grow the dataset."
            )


def eval_shard(size: int) -> range:
    """This rank's part of an eval set of ``size`` samples (every ``n``-th one, ``n`` the
    data-parallel ranks: one tensor-parallel group evaluates one part), for ``Task.evaluate``;
    the whole range outside torch.distributed."""
    data = mesh.current()
    if data is not None:
        return range(data.rank, size, data.size)
    if not dist.is_initialized():
        return range(size)
    return range(dist.get_rank(), size, dist.get_world_size())


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
