"""Every exception a user may catch, each with its exit code. Each message names the bad value and
the fix.

The storage layer's errors (``storage.errors``, torch-free) are re-exported here, so one import
serves: ``from elastictrain.errors import StorageUnavailableError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from storage.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    FileConflictError,
    NewerFormatError,
    StaleWriterError,
    StorageError,
    StorageFullError,
    StorageNotUsableError,
    StorageUnavailableError,
)

EXIT_CRASH = 1  # an unexpected failure: torchrun restarts the group
EXIT_USER_ERROR = 2
EXIT_INIT_TIMEOUT = 3
EXIT_HUNG = 4
EXIT_TIMEOUT = 5
EXIT_ORPHANED = 6  # the torchrun agent died; exiting so no zombie writer is left behind
EXIT_STORAGE = 7  # storage stayed unusable past --storage-retry-deadline
EXIT_PEER_SILENT = 8  # a peer (or the job's store) sent no heartbeat for --silent-timeout
EXIT_EVICTED = 9  # this rank's node was evicted as a straggler (--straggler-action evict)
EXIT_NUMERICAL = 10  # the training state went or stayed non-finite: nothing non-finite committed
EXIT_PREEMPTED = (
    75  # EX_TEMPFAIL: stopped on request with a checkpoint committed; relaunch to continue
)


class ElasticTrainError(Exception):
    """Base class of every error raised by ``elastictrain``."""

    exit_code = EXIT_USER_ERROR
    traceback_helps = True
    """Whether the log shows the traceback of a crash (exit 1); False when the message is all."""


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


class StoreSilentError(ElasticTrainError, TimeoutError):
    """The job's c10d store accepted a connection and stopped answering: its host is frozen."""

    exit_code = EXIT_PEER_SILENT


class NodeEvictedError(ElasticTrainError):
    """This rank's node was evicted as a straggler: the others go on without it, in place."""

    exit_code = EXIT_EVICTED
    traceback_helps = False


class NodeUnhealthyError(NodeEvictedError):
    """This rank's node failed its self-check at a start (``cluster.self_check``), or a spare
    node failed it when called: the job goes on without the node."""


class SelfCheckFailedError(ElasticTrainError):
    """A node failed its self-check, and the job cannot go on without it (too few nodes left,
    it serves the job's store, no torchrun restart left): every rank stops, naming each reason."""


class NodesLeftOutError(ElasticTrainError):
    """Without ``--replace-in-place``: a node failed its self-check and stopped its torchrun
    agent; the other ranks exit so torchrun re-forms the group without it."""

    exit_code = EXIT_CRASH
    traceback_helps = False


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


class NumericalFaultError(ElasticTrainError):
    """A numerical fault a rollback did not clear (non-finite steps, or a loss spike, straight
    back after it), with no copy to roll back to, or a checkpoint that would have held a
    non-finite tensor: every rank stops, naming the steps, the samples or the tensors; the
    committed checkpoints are all finite."""

    exit_code = EXIT_NUMERICAL
    traceback_helps = False


class CheckpointFailedError(ElasticTrainError):
    """Rank 0 could not commit a checkpoint the run cannot go on without (all ranks raise it)."""

    exit_code = EXIT_STORAGE


class Preempted(SystemExit):
    """Raised on every rank once a stop signal (SIGTERM, Ctrl-C, ...) has been agreed and the
    checkpoint of that step committed. Exit code 75: relaunch to continue. Catch it to clean up
    first; it is a ``SystemExit``, so ``except Exception`` will not."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step, self.signal_name = step, signal_name

    def __str__(self) -> str:
        return f"preempted ({self.signal_name}) at step {self.step}: checkpoint committed"


def exit_code(error: BaseException | type[BaseException]) -> int:
    """The process exit code for an error the runner stops on (its ``exit_code``). The storage
    layer's errors carry none, since it knows nothing of processes: a location that fails its
    probe needs the user (2); storage that went away mid-run (7)."""
    kind = error if isinstance(error, type) else type(error)
    if hasattr(kind, "exit_code"):
        return kind.exit_code
    if issubclass(kind, StorageUnavailableError) and not issubclass(kind, StorageNotUsableError):
        return EXIT_STORAGE
    if issubclass(kind, (StorageError, ElasticTrainError)):
        return EXIT_USER_ERROR
    return EXIT_CRASH


EXIT_CODES: dict[int, tuple[str, str]] = {
    0: ("`FINISHED N steps`", "done, final checkpoint committed"),
    EXIT_PREEMPTED: (
        "`PREEMPTED (SIGTERM) at step N: checkpoint committed`",
        "stopped by a signal or Ctrl-C with zero lost steps; relaunch to continue",
    ),
    130: (
        "`ABORTED: SIGINT after Ctrl-C; exiting 130 now`",
        "a second Ctrl-C: stopped at once, the last committed checkpoint is kept",
    ),
    EXIT_USER_ERROR: (
        "`FAILED (exit 2): <error>: ...`",
        "bad input, a checkpoint of another model or of a newer release, an unusable checkpoint "
        "location, nodes that do not share it, or a node that failed its self-check when the job "
        "cannot go on without it; nothing was changed",
    ),
    EXIT_INIT_TIMEOUT: ("`... did not join within --init-timeout (900s)`", "a rank never arrived"),
    EXIT_HUNG: (
        "`HANG DETECTED: no progress for 600.0s in phase 'training' after step N`",
        "hang watchdog, stacks above it",
    ),
    EXIT_TIMEOUT: (
        "`FAILED (exit 5): CollectiveTimeoutError: training step N did not complete within "
        "--collective-timeout=600s`",
        "a skew beyond the budget",
    ),
    EXIT_ORPHANED: (
        "`ORPHANED: the torchrun agent (pid N) is gone`",
        "the agent died alone; the worker exits instead of training on as a zombie writer",
    ),
    EXIT_STORAGE: (
        "`FAILED (exit 7): CheckpointFailedError: the final checkpoint at step N could not be "
        "committed: ...`",
        "storage stayed down past `--storage-retry-deadline` for a checkpoint the run cannot skip "
        "(see `--on-storage-failure`); committed checkpoints are untouched",
    ),
    EXIT_PEER_SILENT: (
        "`PEER SILENT: no heartbeat from rank N on host H for 16.0s ...`, or `FAILED (exit 8): "
        "StoreSilentError: torchrun's rendezvous store at H:P accepted the connection but did "
        "not answer ...`",
        "a frozen peer, or a frozen host serving the job's store, found by liveness in "
        "`--silent-timeout`; torchrun re-forms the group without it",
    ),
    EXIT_EVICTED: (
        "`FAILED (exit 9): NodeEvictedError: node N (ranks [...], host H) is a straggler ...`",
        "`--straggler-action evict` dropped this rank's node, or it failed its self-check at a "
        "start (`NodeUnhealthyError`); the others went on without it. The node's torchrun agent "
        "is stopped (SIGTERM), and exits 1",
    ),
    EXIT_NUMERICAL: (
        "`FAILED (exit 10): NumericalFaultError: steps A-B had a non-finite loss or gradient ...`",
        "a numerical fault came straight back after a rollback (more than "
        "`--max-consecutive-skips` non-finite steps in a row, or a loss spike), no copy was "
        "left to roll back to, or a checkpoint would have held a NaN or an infinity (named). "
        "The message lists the steps and sample ids: relaunch with `--skip-steps` to skip them. "
        "Nothing non-finite was committed",
    ),
    EXIT_CRASH: (
        "a traceback, or `FAILED (exit 1): NodesLeftOutError: ...`",
        "a crash, or (without `--replace-in-place`) another node failed its self-check and left; "
        "torchrun restarts the group",
    ),
}
"""Every exit code the runner ends with: (its final log line, what it means). docs/troubleshooting.md
shows them as ``python -m elastictrain.errors`` prints them."""


def markdown() -> str:
    """The exit-code table of docs/troubleshooting.md, with the errors that end with each code."""
    rows = ["| code | errors | final line | meaning |", "|---|---|---|---|"]
    for code, (line, meaning) in EXIT_CODES.items():
        names = [n for n in __all__ if exit_code(globals()[n]) == code]
        errors = ", ".join(f"`{n}`" for n in names) or "-"
        rows.append(f"| {code} | {errors} | {line} | {meaning} |")
    return "\n".join(rows)


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


__all__ = [
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointFailedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DataLoadError",
    "ElasticTrainError",
    "FileConflictError",
    "InitTimeoutError",
    "NodeEvictedError",
    "NodeUnhealthyError",
    "NodesLeftOutError",
    "NumericalFaultError",
    "NewerFormatError",
    "OrphanedError",
    "Preempted",
    "SelfCheckFailedError",
    "StaleWriterError",
    "StorageError",
    "StorageFullError",
    "StorageNotSharedError",
    "StorageNotUsableError",
    "StorageUnavailableError",
    "StoreSilentError",
    "TaskLoadError",
    "UnsafeCheckpointError",
]


if __name__ == "__main__":
    print(markdown())


class RecurringFailureError(ElasticTrainError):
    """The same rank's training process died at the same step again (``--replace-in-place``):
    every rank stops with this error instead of replacing it forever."""

    exit_code = EXIT_CRASH
    traceback_helps = False  # the dead rank's own log has the cause


class LiveStateCorruptError(ElasticTrainError, RuntimeError):
    """``--replace-in-place``: the state a survivor sent did not match its checksum on arrival;
    the epoch ends and torchrun restarts the group from the checkpoints."""

    exit_code = EXIT_CRASH
