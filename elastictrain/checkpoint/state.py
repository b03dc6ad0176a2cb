"""Capture and restore training state: model, optimizer, LR scheduler, data position.

Written in the flat format of ``snapshot`` (tensor bytes + a ``weights_only`` skeleton); files
written by ``torch.save`` (older elastictrain, or by hand) are still read. Loading never runs pickled
code. ``map_location`` remaps whatever device the tensors were saved from to this rank's device.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elastictrain.checkpoint import staging as snapshot
from elastictrain.errors import CheckpointMismatchError, UnsafeCheckpointError

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


def capture(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    step: int,
    fingerprint: DataFingerprint | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """References to the live state (serialize before the next optimizer step). ``extra`` is the
    library user's own state: tensors and plain Python values."""
    state = {
        "version": STATE_VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "progress": {"step": step},
        "data": fingerprint.as_dict() if fingerprint is not None else {},
    }
    if extra is not None:
        state["extra"] = extra
    return state


def to_bytes(state: dict[str, Any]) -> bytes:
    """``state`` as one flat file (a throwaway staging buffer; the runner reuses its own)."""
    return bytes(snapshot.Staging().snapshot(state).data)


def from_bytes(data: bytes | bytearray, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a flat file (tensors are views into ``data`` on CPU) or a ``torch.save`` file."""
    with _refuse_unsafe():
        if snapshot.is_flat(data):
            return snapshot.load(data, map_location)
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def from_bytes_file(f: Any, map_location: Any = "cpu") -> dict[str, Any]:
    """Load from a seekable file object; ``map_location="meta"`` reads no tensor data."""
    with _refuse_unsafe():
        f.seek(-len(snapshot.MAGIC), io.SEEK_END)
        flat = f.read() == snapshot.MAGIC
        f.seek(0)
        if flat and map_location == "meta":
            return snapshot.load_meta(f)
        if flat:
            return snapshot.load(bytearray(f.read()), map_location)
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


def check_compatible(
    model: nn.Module, state: dict[str, Any], fingerprint: DataFingerprint | None, where: str
) -> None:
    """Raise CheckpointMismatchError naming the first offending keys before anything is loaded."""
    saved = state.get("model")
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
    saved_data = state.get("data", {})
    for name, value in (fingerprint.as_dict() if fingerprint else {}).items():
        if name in saved_data and saved_data[name] != value:
            problems.append(f"{name} was {saved_data[name]} when saved, is {value} now")
    if problems:
        raise CheckpointMismatchError(
            f"Checkpoint {where} does not fit this run: {'; '.join(problems)}. Nothing was loaded or "
            "deleted. Use the same model and task options, or point --checkpoint-dir at a new location."
        )


def restore(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any]
) -> int:
    """Load ``state`` in place; returns the number of completed steps it holds."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    return int(state["progress"]["step"])
