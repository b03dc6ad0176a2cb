"""elastictrain: a fault-tolerant, elastic PyTorch training runner with persistent checkpoints."""

from elastictrain.inspection import load_checkpoint
from elastictrain.manager import CheckpointManager, Preempted
from elastictrain.task import Task
from elastictrain.version import __version__

__all__ = ["CheckpointManager", "Preempted", "Task", "__version__", "load_checkpoint"]
