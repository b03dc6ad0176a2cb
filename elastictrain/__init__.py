"""elastictrain: a fault-tolerant, elastic PyTorch training runner with persistent checkpoints.

The public API. The errors are imported eagerly (they are plain Python); everything that needs
torch is imported on first use, so ``python -m elastictrain ls`` and ``import storage`` stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from elastictrain.errors import (
    CheckpointFailedError,
    CheckpointMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    ElasticTrainError,
    InitTimeoutError,
    OrphanedError,
    TaskLoadError,
    UnsafeCheckpointError,
)
from elastictrain.version import __version__
from storage.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StaleWriterError,
    StorageError,
    StorageNotUsableError,
    StorageUnavailableError,
)

if TYPE_CHECKING:
    from elastictrain.checkpoint.inspection import load_checkpoint
    from elastictrain.checkpoint.manager import CheckpointManager
    from elastictrain.checkpoint.session import Preempted
    from elastictrain.dist import init_distributed
    from elastictrain.task import Task, eval_shard

_LAZY = {
    "CheckpointManager": "elastictrain.checkpoint.manager",
    "Preempted": "elastictrain.checkpoint.session",
    "Task": "elastictrain.task",
    "eval_shard": "elastictrain.task",
    "init_distributed": "elastictrain.dist",
    "load_checkpoint": "elastictrain.checkpoint.inspection",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later lookups skip this function
        return value
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")


__all__ = [
    "CheckpointCorruptError",
    "CheckpointFailedError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ElasticTrainError",
    "InitTimeoutError",
    "OrphanedError",
    "Preempted",
    "StaleWriterError",
    "StorageError",
    "StorageNotUsableError",
    "StorageUnavailableError",
    "Task",
    "TaskLoadError",
    "UnsafeCheckpointError",
    "__version__",
    "eval_shard",
    "init_distributed",
    "load_checkpoint",
]
