"""Exception hierarchy of the runner. Each message names the bad value and the fix."""

from __future__ import annotations


class ElasticTrainError(Exception):
    """Base class of every error raised by ``elastictrain``."""


class ConfigError(ElasticTrainError, ValueError):
    """A flag or option value that can never work."""


class TaskLoadError(ElasticTrainError, ImportError):
    """``--task MODULE:CALLABLE`` could not be imported or did not return a Task."""


class CheckpointMismatchError(ElasticTrainError, ValueError):
    """A checkpoint does not fit this run's model or data (keys, shapes, batch size)."""


class InitTimeoutError(ElasticTrainError, TimeoutError):
    """Process-group initialisation did not finish within --init-timeout."""
