"""Checkpoints: saved by rank 0 (or by every rank, for sharded state), committed by rank 0, resumed
from the best copy on any tier. The contracts are in :mod:`.api`; the layout is decided once, in
:mod:`.modes`. CONTRIBUTING.md's code map says which subpackage owns what.

The public surface, imported on first use: ``python -m elastictrain ls`` imports the format
modules it needs, and must not pay for torch through this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastictrain import lazy

if TYPE_CHECKING:
    from elastictrain.checkpoint.api import (
        Reason,
        Restored,
        ResumeOrigin,
        SaveOutcome,
        Tier,
    )
    from elastictrain.checkpoint.checkpointer import Checkpointer, Resumed
    from elastictrain.checkpoint.manager import CheckpointManager
    from elastictrain.checkpoint.modes import mode_for
    from elastictrain.checkpoint.readers.load import load_checkpoint
    from elastictrain.checkpoint.session import CheckpointSession

_LAZY = {
    "CheckpointManager": "elastictrain.checkpoint.manager",
    "CheckpointSession": "elastictrain.checkpoint.session",
    "Checkpointer": "elastictrain.checkpoint.checkpointer",
    "Reason": "elastictrain.checkpoint.api",
    "Restored": "elastictrain.checkpoint.api",
    "ResumeOrigin": "elastictrain.checkpoint.api",
    "Resumed": "elastictrain.checkpoint.checkpointer",
    "SaveOutcome": "elastictrain.checkpoint.api",
    "Tier": "elastictrain.checkpoint.api",
    "load_checkpoint": "elastictrain.checkpoint.readers.load",
    "mode_for": "elastictrain.checkpoint.modes",
}


def __getattr__(name: str) -> Any:
    value = lazy.resolve(globals(), _LAZY, name)
    if value is not lazy.MISSING:
        return value
    raise AttributeError(f"module 'elastictrain.checkpoint' has no attribute {name!r}")


__all__ = [
    "CheckpointManager",
    "CheckpointSession",
    "Checkpointer",
    "Reason",
    "Restored",
    "ResumeOrigin",
    "Resumed",
    "SaveOutcome",
    "Tier",
    "load_checkpoint",
    "mode_for",
]
