"""Exception hierarchy of the runner. Each message names the bad value and the fix."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

EXIT_CRASH = 1  # an unexpected failure: torchrun restarts the group
EXIT_USER_ERROR = 2
EXIT_INIT_TIMEOUT = 3
EXIT_HUNG = 4
EXIT_TIMEOUT = 5
EXIT_ORPHANED = 6  # the torchrun agent died; exiting so no zombie writer is left behind
EXIT_STORAGE = 7  # storage stayed unusable past --storage-retry-deadline
EXIT_PREEMPTED = (
    75  # EX_TEMPFAIL: stopped on request with a checkpoint committed; relaunch to continue
)


class ElasticTrainError(Exception):
    """Base class of every error raised by ``elastictrain``."""

    exit_code = EXIT_USER_ERROR


class ConfigError(ElasticTrainError, ValueError):
    """A flag or option value that can never work."""


class TaskLoadError(ElasticTrainError, ImportError):
    """``--task MODULE:CALLABLE`` could not be imported or did not return a Task."""


class CheckpointMismatchError(ElasticTrainError, ValueError):
    """A checkpoint does not fit this run's model or data (keys, shapes, batch size)."""


class StorageNotSharedError(ElasticTrainError):
    """A multi-node job whose nodes do not all see the checkpoint location rank 0 uses."""


class UnsafeCheckpointError(ElasticTrainError):
    """A checkpoint would need arbitrary unpickling to load; it is refused, never executed."""


class InitTimeoutError(ElasticTrainError, TimeoutError):
    """Process-group initialisation did not finish within --init-timeout."""

    exit_code = EXIT_INIT_TIMEOUT


class CollectiveTimeoutError(ElasticTrainError, TimeoutError):
    """A training collective or checkpoint barrier outlived its timeout (names which one)."""

    exit_code = EXIT_TIMEOUT


class OrphanedError(ElasticTrainError):
    """The torchrun agent died; this worker must not train or commit any further."""

    exit_code = EXIT_ORPHANED


class DataLoadError(ElasticTrainError, RuntimeError):
    """Loading a batch failed: a loader worker died, or ``dataset[i]``/``collate_fn`` raised. A
    crash (exit 1, with the cause's traceback): torchrun restarts the group."""

    exit_code = EXIT_CRASH


class CheckpointFailedError(ElasticTrainError):
    """Rank 0 could not commit a checkpoint the run cannot go on without (all ranks raise it)."""

    exit_code = EXIT_STORAGE


@contextlib.contextmanager
def named_timeout(setting: str, value: float, what: str) -> Iterator[None]:
    """Turn a backend timeout (gloo/nccl raise RuntimeError) into an error that names the setting
    to raise and its value."""
    try:
        yield
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise CollectiveTimeoutError(
            f"{what} did not complete within {setting}={value:.0f}s: a rank is slower than that "
            f"budget, stuck, or gone. Raise {setting} above the worst expected skew, or see the "
            f"straggler report. ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e
