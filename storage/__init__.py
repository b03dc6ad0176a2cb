"""Checkpoint storage over fsspec URLs: payload first, manifest last; verified reads.

Imports nothing from torch. Use :func:`open_store` to get a :class:`CheckpointStore`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from storage.api import Store, VerifiedFiles
from storage.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    FileConflictError,
    NewerFormatError,
    StaleWriterError,
    StorageConfigError,
    StorageError,
    StorageFullError,
    StorageNotUsableError,
    StorageUnavailableError,
)
from storage.hashing import DEFAULT_ALGORITHM
from storage.manifest import FileEntry, Manifest
from storage.retry import RetryPolicy, is_transient
from storage.store import Checkpoint, CheckpointStore, ListedCheckpoint
from storage.urls import parse_option, redact_options, redact_url


def open_store(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    checksum: str = DEFAULT_ALGORITHM,
) -> CheckpointStore:
    """Open the checkpoint store rooted at ``url`` (local path or any fsspec URL); new files are
    hashed with ``checksum`` (``storage.hashing.ALGORITHMS``)."""
    return CheckpointStore(url, storage_options=storage_options, retry=retry, checksum=checksum)


__all__ = [
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "DEFAULT_ALGORITHM",
    "FileConflictError",
    "FileEntry",
    "ListedCheckpoint",
    "Manifest",
    "NewerFormatError",
    "RetryPolicy",
    "StorageConfigError",
    "StorageError",
    "StaleWriterError",
    "StorageFullError",
    "StorageNotUsableError",
    "StorageUnavailableError",
    "Store",
    "VerifiedFiles",
    "is_transient",
    "open_store",
    "parse_option",
    "redact_options",
    "redact_url",
]
