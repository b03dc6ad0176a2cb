"""elastictrain: a fault-tolerant, elastic PyTorch training runner with persistent checkpoints.

The public API: what a user calls. Every exception a user may catch is in
:mod:`elastictrain.errors`. Everything that needs torch is imported on first use, so
``python -m elastictrain ls`` and ``import storage`` stay light.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from elastictrain import lazy
from elastictrain.version import __version__

if TYPE_CHECKING:
    from elastictrain.checkpoint.readers.load import load_checkpoint
    from elastictrain.errors import Preempted
    from elastictrain.library import CheckpointManager, init_distributed
    from elastictrain.task import Task, eval_shard

_LAZY = {
    "CheckpointManager": "elastictrain.library",
    "Preempted": "elastictrain.errors",
    "Task": "elastictrain.task",
    "eval_shard": "elastictrain.task",
    "init_distributed": "elastictrain.library",
    "load_checkpoint": "elastictrain.checkpoint.readers.load",
}


def __getattr__(name: str) -> Any:
    value = lazy.resolve(globals(), _LAZY, name)
    if value is not lazy.MISSING:
        return value
    # Not ``from elastictrain import errors``: that asks this function for ``errors`` first, and
    # so does every ``from elastictrain import <submodule>`` not yet imported.
    errors = importlib.import_module("elastictrain.errors")
    if name in errors.__all__:  # the top level exported every error until 0.x; one release more
        warnings.warn(
            f"elastictrain.{name} is deprecated: import it from elastictrain.errors",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(errors, name)
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")


__all__ = [
    "CheckpointManager",
    "Preempted",
    "Task",
    "__version__",
    "eval_shard",
    "init_distributed",
    "load_checkpoint",
]
