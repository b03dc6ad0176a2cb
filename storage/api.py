"""The store contracts the checkpoint package is written against, so any object that keeps them
can stand in for :class:`storage.CheckpointStore`: the fast tier's bytes fetched from node memory
(``elastictrain.checkpoint.resume.fast_copies``) are read by the same code that reads S3.

Both are ``runtime_checkable`` (``isinstance`` checks the names, not the behaviour); the
behaviour is pinned by ``tests/storage/test_conformance.py``, run over every implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from storage.hashing import Digest
from storage.manifest import FileEntry, Manifest
from storage.ranges import Range


@runtime_checkable
class VerifiedFiles(Protocol):
    """Reads of one committed checkpoint's files, each byte verified against its manifest: what
    a sharded reader needs."""

    safe_url: str
    """Where the bytes come from, fit for an error message (no credentials)."""

    def read_file(self, manifest: Manifest, name: str) -> bytes | bytearray | memoryview:
        """The whole of file ``name``; raises ``CheckpointCorruptError`` if it does not verify."""

    def read_ranges(
        self, manifest: Manifest, name: str, blocks: list[str], ranges: list[Range]
    ) -> tuple[dict[Range, memoryview], int]:
        """Byte ranges of file ``name`` (``blocks``: its block hashes), each checked block by
        block: ({range: bytes}, bytes actually read)."""


@runtime_checkable
class Store(VerifiedFiles, Protocol):
    """A checkpoint location: payload files first, the manifest last (the commit), a fence
    against older writers, and verified reads."""

    url: str

    # -- the fence ---------------------------------------------------------------------------
    def read_fence(self) -> int:
        """The newest writer generation recorded (0 when none)."""

    def advance_fence(self, generation: int) -> int:
        """Claim the location for ``generation``; returns the generation actually used."""

    # -- write -------------------------------------------------------------------------------
    def write_file(
        self,
        step: int,
        name: str,
        data: bytes | memoryview,
        block_size: int = 0,
        checkpoint_bytes: int | None = None,
    ) -> tuple[FileEntry, Digest]:
        """One payload file of ``step``, durable and not yet committed; created once, never
        rewritten (the same bytes again are success, others ``FileConflictError``)."""

    def commit(
        self,
        step: int,
        files: Mapping[str, bytes | memoryview],
        metadata: Mapping[str, Any],
        generation: int = 0,
        before_commit: Callable[[], None] | None = None,
        *,
        replace_older: bool = False,
    ) -> Manifest:
        """Write ``files``, then the manifest that commits them."""

    def commit_written(
        self,
        step: int,
        entries: Mapping[str, FileEntry],
        metadata: Mapping[str, Any],
        generation: int = 0,
        before_commit: Callable[[], None] | None = None,
        *,
        replace_older: bool = False,
    ) -> Manifest:
        """Commit files already written (possibly by other processes); the manifest is created,
        never overwritten, except an older generation's when ``replace_older``."""

    def write_note(self, step: int, name: str, data: bytes) -> None:
        """A small uncommitted file that appears whole or not at all, written once."""

    def read_uncommitted(self, step: int, name: str) -> bytes | None:
        """A file put under ``step`` before any commit (unverified), or None."""

    def names_in(self, step: int) -> set[str]:
        """The file names under ``step``, committed or not."""

    # -- read --------------------------------------------------------------------------------
    def read_manifest(self, step: int) -> Manifest | None:
        """The manifest of ``step``, or None when it is not committed."""

    def is_committed(self, step: int) -> bool:
        """True when ``step`` has a manifest (not verified)."""

    def committed_steps(self) -> list[int]:
        """Steps that have a manifest, oldest first."""

    def ranked_manifests(
        self, on_corrupt: Callable[[int, Exception], None] | None = None
    ) -> list[Manifest]:
        """Committed manifests, newest (generation, step) first; unreadable ones reported."""

    def check_sizes(self, manifest: Manifest) -> None:
        """Every file of ``manifest`` exists at its recorded size (no bytes read)."""

    # -- remove ------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Un-commit ``step`` (manifest first), then remove its files."""

    def uncommit(self, step: int) -> None:
        """Remove only the manifest of ``step``."""

    def apply_retention(
        self, keep_last: int, newest_good: int, keep_every: int | None = None
    ) -> list[int]:
        """Delete what the retention policy lets go; returns the steps deleted."""
