"""Capture and restore training state: model, optimizer, LR scheduler, GradScaler, the task's
extra ``Stateful`` entries, and the data position.

Written in the flat format of ``snapshot`` (tensor bytes + a ``weights_only`` skeleton); files
written by ``torch.save`` (older elastictrain, or by hand) are still read. Loading never runs pickled
code. ``map_location`` remaps whatever device the tensors were saved from to this rank's device.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elastictrain.checkpoint.state import flat as staging
from elastictrain.errors import CheckpointMismatchError, ConfigError, UnsafeCheckpointError

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"  # the name before generations were part of it; still read


def state_file_name(generation: int) -> str:
    """Each writer generation writes its own payload file, so a stale writer working on the same
    step can never overwrite the bytes a newer writer's manifest points to."""
    return f"state-g{generation}.bin"


def state_file_of(metadata: dict[str, Any]) -> str:
    return str(metadata.get("state_file", STATE_FILE))


STATE_VERSION = 1


@dataclass(frozen=True)
class DataFingerprint:
    """What must match for a saved data position to mean the same thing."""

    batch_size: int
    dataset_size: int
    seed: int

    def as_dict(self) -> dict[str, int]:
        return {"batch_size": self.batch_size, "dataset_size": self.dataset_size, "seed": self.seed}


@dataclass
class TrainState:
    """What a checkpoint holds."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    extra: dict[str, Any] | None = None
    """Library mode's own values (tensors and plain Python), back on resume."""
    fingerprint: DataFingerprint | None = None
    """The runner's data settings, checked on resume so another batch size is refused."""
    epoch_of: Callable[[int], int] = lambda step: 0
    """The data epoch a checkpoint after ``step`` completed steps is in."""
    stateful: Mapping[str, Any] = field(default_factory=dict)
    """``Task.state``: name -> object with ``state_dict()``/``load_state_dict()`` (DCP's
    ``Stateful`` shape), saved and restored with the rest; the names must match on resume."""
    scaler: Any = None
    """fp16's ``torch.amp.GradScaler``; its scale and growth tracker are restored exactly."""
    per_rank: Mapping[str, Any] = field(default_factory=dict)
    """State each rank holds on its own (a stream's position): name -> an object with
    ``state_dict()``, ``check_rank_states(states, step, where)`` and ``load_rank_states(states,
    step)``. Gathered from every rank at each save (:meth:`gather`); on resume every rank gets
    every rank's saved state, checked before anything is loaded."""
    export_config: Mapping[str, Any] | None = None
    """``Task.hf_config``: saved with the checkpoint for ``export`` (a JSON-like dict)."""
    gathered: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Every rank's encoded ``per_rank`` states, as of the last :meth:`gather`."""

    def gather(self, all_gather: Callable[[Any], list[Any]]) -> None:
        """On every rank, at an agreed save: collect every rank's ``per_rank`` states (encoded
        in the flat format: loading them never unpickles code)."""
        for name, obj in self.per_rank.items():
            mine = to_bytes(obj.state_dict())
            self.gathered[name] = [
                torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in all_gather(mine)
            ]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP/FSDP-style wrappers, so keys carry no ``module.`` prefix."""
    return getattr(model, "module", model)


# What the flat payload's skeleton may hold: it is loaded with ``weights_only=True``.
_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.Size)


def tied_names(model: nn.Module) -> list[list[str]]:
    """Tied weights as state_dict keys: one list per parameter reached under more than one name,
    in state_dict order (the first is the name an export keeps, as Hugging Face's does). Recorded
    in every checkpoint, so tools that see only tensors (``export``) know which are one."""
    names: dict[int, list[str]] = {}
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def check_plain(tree: Any, where: str) -> None:
    """Raise ConfigError at the first value the flat payload cannot carry (loading never
    unpickles code, so a custom object saved now could never be loaded back)."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            if not isinstance(k, (str, int)):
                raise ConfigError(
                    f"{where} has a key {k!r} of type {type(k).__name__}; use str or int keys."
                )
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(tree, _PLAIN):
        raise ConfigError(
            f"{where} is a {type(tree).__name__}: a checkpoint carries only tensors, numbers, "
            "strings, None and dicts/lists of them (loading never unpickles code). Convert it in "
            "that object's state_dict()/load_state_dict()."
        )


def capture(
    state: TrainState, *, step: int, model: Any = None, optimizer: Any = None
) -> dict[str, Any]:
    """References to the live state (serialize before the next optimizer step). ``model`` and
    ``optimizer``: their state dicts when already taken another way (sharded: DCP's)."""
    payload = {
        "version": STATE_VERSION,
        "model": unwrap(state.model).state_dict() if model is None else model,
        "optimizer": state.optimizer.state_dict() if optimizer is None else optimizer,
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
        "progress": {"step": step},
        "data": state.fingerprint.as_dict() if state.fingerprint is not None else {},
        "tied": tied_names(state.model),
    }
    if state.stateful:
        payload["stateful"] = {name: obj.state_dict() for name, obj in state.stateful.items()}
    if state.export_config is not None:
        payload["export_config"] = dict(state.export_config)
    if state.per_rank:
        payload["per_rank"] = {name: state.gathered.get(name, []) for name in state.per_rank}
    if state.scaler is not None:
        payload["scaler"] = state.scaler.state_dict()
    if state.extra is not None:
        payload["extra"] = state.extra
    return payload


def rank_states(encoded: list[torch.Tensor]) -> list[Any]:
    """Every rank's ``per_rank`` state, decoded from a checkpoint (weights-only)."""
    return [from_bytes(bytearray(t.numpy().tobytes())) for t in encoded]


def to_bytes(state: dict[str, Any]) -> bytes:
    """``state`` as one flat file (a throwaway staging buffer; the runner reuses its own)."""
    return bytes(to_buffer(state))


def to_buffer(state: dict[str, Any]) -> memoryview:
    """:func:`to_bytes` without its copy into ``bytes``: a view of a throwaway staging buffer
    (57 MB copied again cost 30 ms here, in the middle of an in-place recovery)."""
    return staging.Staging().snapshot(state).data


def from_bytes(data: bytes | bytearray, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a flat file (tensors are views into ``data`` on CPU) or a ``torch.save`` file."""
    with _refuse_unsafe():
        if staging.is_flat(data):
            return staging.load(data, map_location)
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def from_bytes_file(f: Any, map_location: Any = "cpu") -> dict[str, Any]:
    """Load from a seekable file object; ``map_location="meta"`` reads no tensor data."""
    with _refuse_unsafe():
        f.seek(-len(staging.MAGIC), io.SEEK_END)
        flat = f.read() == staging.MAGIC
        f.seek(0)
        if flat and map_location == "meta":
            return staging.load_meta(f)
        if flat:
            return staging.load(bytearray(f.read()), map_location)
        return torch.load(f, map_location=map_location, weights_only=True)


@contextlib.contextmanager
def _refuse_unsafe():
    try:
        yield
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            "Refused to load a checkpoint: it holds pickled objects outside torch's weights-only "
            "allowlist, so loading it could run code. It was not written by elastictrain, or it was "
            f"tampered with. Nothing was executed. ({str(e).splitlines()[0][:200]})"
        ) from e


def check_compatible(state: TrainState, payload: dict[str, Any], where: str) -> None:
    """Raise CheckpointMismatchError naming the first offending keys before anything is loaded."""
    model, fingerprint = unwrap(state.model), state.fingerprint
    saved = payload.get("model")
    if not isinstance(saved, dict):
        raise CheckpointMismatchError(
            f"Checkpoint {where} has no model state; it was not written by elastictrain."
        )
    current = model.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(current[k].shape)}"
        for k in sorted(set(saved) & set(current))
        if tuple(saved[k].shape) != tuple(current[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if shapes:
        problems.append(f"shape mismatch {shapes[:5]}{' ...' if len(shapes) > 5 else ''}")
    saved_entries, entries = set(payload.get("stateful", {})), set(state.stateful)
    if saved_entries != entries:
        # An entry started fresh (or dropped) would silently break exact resume.
        problems.append(
            f"Task.state entries {sorted(entries)} vs {sorted(saved_entries)} in the checkpoint"
        )
    saved_per_rank = payload.get("per_rank", {})
    if set(saved_per_rank) != set(state.per_rank):
        problems.append(
            f"per-rank state {sorted(state.per_rank)} vs {sorted(saved_per_rank)} in the "
            "checkpoint (a stream, Task.dataset as an IterableDataset, saves each rank's position)"
        )
    else:
        step = int(payload.get("progress", {}).get("step", 0))
        for name, obj in state.per_rank.items():
            obj.check_rank_states(rank_states(saved_per_rank[name]), step, where)
    saved_data = payload.get("data", {})
    for name, value in (fingerprint.as_dict() if fingerprint else {}).items():
        if name in saved_data and saved_data[name] != value:
            problems.append(f"{name} was {saved_data[name]} when saved, is {value} now")
    if problems:
        raise CheckpointMismatchError(
            f"Checkpoint {where} does not fit this run: {'; '.join(problems)}. Nothing was loaded or "
            "deleted. Use the same model and task options, or point --checkpoint-dir at a new location."
        )


def keyed_by_name(optimizer: Any) -> bool:
    """Whether an optimizer state dict names its parameters (``get_state_dict``'s form, as a
    sharded checkpoint saves it) rather than numbering them (``Optimizer.state_dict``'s)."""
    groups = optimizer.get("param_groups", []) if isinstance(optimizer, dict) else []
    return any(isinstance(p, str) for g in groups for p in g.get("params", []))


def optimizer_by_name(state: TrainState, saved: dict[str, Any], where: str) -> dict[str, Any]:
    """``Optimizer.state_dict()``'s numbered parameters as ``get_state_dict``'s names: the k-th
    saved parameter is the k-th of this run's optimizer (both built from ``model.parameters()``).

    Raises:
        CheckpointMismatchError: the optimizer holds another number of parameters.
    """
    names = {id(p): n for n, p in unwrap(state.model).named_parameters()}
    mine = [names[id(p)] for g in state.optimizer.param_groups for p in g["params"]]
    numbers = [k for g in saved["param_groups"] for k in g["params"]]
    if len(numbers) != len(mine):
        raise CheckpointMismatchError(
            f"Checkpoint {where} does not fit this run: its optimizer holds {len(numbers)} "
            f"parameters, this run's {len(mine)}. Nothing was loaded or changed. Use the same "
            "model and optimizer."
        )
    by = dict(zip(numbers, mine, strict=True))
    return {
        "state": {by[k]: v for k, v in saved["state"].items()},
        "param_groups": [
            {**g, "params": [by[k] for k in g["params"]]} for g in saved["param_groups"]
        ],
    }


def restore(state: TrainState, payload: dict[str, Any], *, model_and_optimizer: bool = True) -> int:
    """Load ``payload`` into ``state`` in place; returns the number of completed steps it holds.
    ``model_and_optimizer=False``: those are loaded already (sharded: by DCP's set_state_dict)."""
    if model_and_optimizer and keyed_by_name(payload["optimizer"]):
        # A sharded checkpoint consolidated for a replicated run: DCP's form, parameters by name.
        from elastictrain.checkpoint.state import dcp

        dcp.load_state_dicts(
            unwrap(state.model), state.optimizer, payload["model"], payload["optimizer"]
        )
    elif model_and_optimizer:
        unwrap(state.model).load_state_dict(payload["model"])
        state.optimizer.load_state_dict(payload["optimizer"])
    if state.scheduler is not None and payload.get("scheduler") is not None:
        state.scheduler.load_state_dict(payload["scheduler"])
    for name, obj in state.stateful.items():
        obj.load_state_dict(payload["stateful"][name])
    for name, obj in state.per_rank.items():
        obj.load_rank_states(
            rank_states(payload["per_rank"][name]), int(payload["progress"]["step"])
        )
    saved_scaler = payload.get("scaler")
    if state.scaler is not None and saved_scaler is not None:
        state.scaler.load_state_dict(saved_scaler)
    elif state.scaler is not None:
        # Switching to fp16 mid-run is allowed: the scaler starts as a fresh run's would.
        logger.warning(
            "the checkpoint has no GradScaler state (not saved under fp16): the loss "
            "scale starts at its default"
        )
    return int(payload["progress"]["step"])
