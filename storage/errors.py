"""Exception hierarchy of the checkpoint store.

Every error says what happened, to which object (a URL with no secrets), and what to do.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every error raised by ``storage``."""


class StorageConfigError(StorageError, ValueError):
    """A URL or storage option that can never work: unknown protocol, bad value."""


class StorageUnavailableError(StorageError, OSError):
    """The storage could not be reached or used (after retrying transient errors)."""


class CheckpointNotFoundError(StorageError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CheckpointCorruptError(StorageError):
    """A committed checkpoint failed verification: a size or checksum mismatch, or a bad manifest."""


class StorageNotUsableError(StorageUnavailableError):
    """The startup probe failed: the location is missing, read-only, unreachable, or the credentials
    are rejected. Names the likely cause; the user must fix the location or its options."""


class StorageFullError(StorageUnavailableError):
    """The location ran out of space or quota while writing; earlier checkpoints are intact."""


class NewerFormatError(StorageError):
    """A committed checkpoint was written in a newer format than this version reads. It is never
    skipped as corrupt, overwritten or deleted: the run stops, and an upgrade reads it."""


class CheckpointExistsError(StorageError, FileExistsError):
    """A committed checkpoint already holds this step; committed checkpoints are never overwritten."""


class FileConflictError(StorageError, FileExistsError):
    """A file under a checkpoint's name already exists with other bytes. Such a file is written
    once and never again, so nothing was overwritten: the same step was saved twice with
    different contents."""


class StaleWriterError(StorageError):
    """A writer from an older generation tried to commit after a newer generation took over."""
