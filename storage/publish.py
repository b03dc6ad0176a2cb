"""Writing a checkpoint: every file published once, the manifest last.

A file under a checkpoint's name is created, never opened for writing again (``Backend.create``):
a second write of the same bytes is success (a retry whose first try landed, the same copy sent
twice), other bytes raise :class:`FileConflictError` and change nothing. The manifest is
published the same way, so two writers racing for one step cannot both commit it, and the one
file replaced by design, an older generation's manifest, is swapped whole for the new one before
its files go. Mixed into :class:`storage.store.CheckpointStore`.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Mapping
from typing import Any

from storage.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    FileConflictError,
    StaleWriterError,
    StorageFullError,
    StorageUnavailableError,
)
from storage.hashing import Digest, digest, hash_in_background, hash_stream
from storage.manifest import MANIFEST_NAME, FileEntry, Manifest, check_file_name, step_dir_name


class Publishing:
    """Needs the store's ``_backend``, ``_call``, ``_step_dir``, ``safe_url``, ``checksum``,
    ``read_fence`` and ``is_committed``."""

    def write_file(
        self,
        step: int,
        name: str,
        data: bytes | memoryview,
        block_size: int = 0,
        checkpoint_bytes: int | None = None,
    ) -> tuple[FileEntry, Digest]:
        """Publish one payload file of ``step`` (durable, not yet committed); its manifest entry
        and digest. Any rank may call this for its own files; only a commit makes them count.

        Write-once: the name is created, never opened for writing again. When it already holds
        the same bytes (a retried write that landed, the same copy sent twice) that is success;
        other bytes raise :class:`FileConflictError` and change nothing."""
        check_file_name(name)
        path = self._backend.join(self._step_dir(step), name)
        what = f"write {step_dir_name(step)}/{name}"
        # Hash while writing: both release the GIL, so a big payload costs max(write, hash).
        pending = hash_in_background(data, block_size, self.checksum)
        try:
            created = self._call(what, lambda: self._backend.create(path, data))
        except StorageUnavailableError as e:
            if getattr(e.__cause__, "errno", None) not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # Nothing to clean: a failed create leaves only a temporary name, which it removes.
            whole = f", the whole checkpoint {checkpoint_bytes} bytes" if checkpoint_bytes else ""
            raise StorageFullError(
                f"No space left (or quota exceeded) under {self.safe_url!r} writing step {step}: "
                f"{name} needs {len(data)} bytes{whole}. Earlier checkpoints are intact. Free "
                "space, raise the quota, or lower --keep-last."
            ) from e.__cause__
        done = pending.result() if pending else digest(data, block_size, self.checksum)
        entry = FileEntry(len(data), done.root, block_size=block_size, algorithm=self.checksum)
        if not created:
            self._check_same(step, name, entry)
        return entry, done

    def _check_same(self, step: int, name: str, entry: FileEntry) -> None:
        """The file already under ``name`` must be the one ``entry`` describes; else
        :class:`FileConflictError` (it is left as it was)."""
        path = self._backend.join(self._step_dir(step), name)
        size = self._call(f"size {step_dir_name(step)}/{name}", lambda: self._backend.size(path))
        found = ""
        if size == entry.size:
            found = self._call(
                f"hash {step_dir_name(step)}/{name}",
                lambda: hash_stream(self._backend, path, entry.block_size, entry.algorithm)[1],
            )
            if found == entry.checksum:
                return
        raise FileConflictError(
            f"{step_dir_name(step)}/{name} under {self.safe_url!r} already exists with other "
            f"contents ({size} bytes{f', {entry.algorithm} {found[:16]}...' if found else ''}; "
            f"this write: {entry.size} bytes, {entry.checksum[:16]}...). A checkpoint's files "
            f"are written once and never again, so nothing was overwritten: step {step} was "
            "written twice with different contents."
        )

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
        """Write ``files`` for ``step``, then the manifest that commits them; returns the manifest.
        ``before_commit`` runs right before the commit point: what it raises aborts the commit.
        ``replace_older``: see :meth:`commit_written`."""
        if not replace_older:
            self._refuse_committed(step)
        total = sum(len(d) for d in files.values())
        entries = {
            name: self.write_file(step, name, data, checkpoint_bytes=total)[0]
            for name, data in files.items()
        }
        return self.commit_written(
            step, entries, metadata, generation, before_commit, replace_older=replace_older
        )

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
        """Commit files already written by :meth:`write_file` (possibly by other processes): the
        manifest listing them, last. Fenced: an older generation than the store's may not commit.

        The manifest is published like any file (created, never overwritten), so a step another
        writer committed first raises :class:`CheckpointExistsError` however close the race.
        ``replace_older``: a manifest already there of an *older* generation (or unreadable) is
        replaced, in one atomic swap, and only then are its own files deleted: the step is
        committed at every moment, by the old writer or the new."""
        fence = self.read_fence()
        if generation < fence:
            raise StaleWriterError(
                f"Refusing to commit step {step} under {self.safe_url!r}: this writer's generation "
                f"{generation} is older than the store's {fence}; a newer attempt owns it now."
            )
        if before_commit is not None:
            before_commit()
        manifest = Manifest(
            step=step, files=dict(entries), metadata=dict(metadata), generation=generation
        )
        manifest_path = self._backend.join(self._step_dir(step), MANIFEST_NAME)
        raw = manifest.to_json()
        # The commit point: before this line the checkpoint does not exist.
        what = f"commit {step_dir_name(step)}"
        if not self._call(what, lambda: self._backend.create(manifest_path, raw)):
            self._commit_over(manifest, raw, replace_older)
        return manifest

    def _commit_over(self, manifest: Manifest, raw: bytes, replace_older: bool) -> None:
        """The step already has a manifest: ours (a retried commit that had landed) is success; an
        older generation's is swapped for ours when ``replace_older``; anything else is refused."""
        step = manifest.step
        path = self._backend.join(self._step_dir(step), MANIFEST_NAME)
        try:
            existing_raw = self._call(
                f"read manifest of step {step}", lambda: self._backend.read(path)
            )
        except FileNotFoundError:
            existing_raw = None  # deleted since (retention, or the newer writer's swap): refuse
        if existing_raw == raw:
            return
        existing: Manifest | None = None
        if existing_raw is not None:
            with contextlib.suppress(CheckpointCorruptError):  # unreadable: nobody can resume it
                existing = Manifest.from_json(
                    existing_raw, where=f"{self.safe_url}/{step_dir_name(step)}"
                )
        older = existing_raw is not None and (
            existing is None or existing.generation < manifest.generation
        )
        if not (replace_older and older):
            raise CheckpointExistsError(
                f"Checkpoint step {step} is already committed under {self.safe_url!r}"
                + (f" by generation {existing.generation}" if existing else "")
                + "; committed checkpoints are never overwritten."
            )
        self._call(f"commit {step_dir_name(step)}", lambda: self._backend.write_atomic(path, raw))
        if existing is not None:
            for name in existing.files.keys() - manifest.files.keys():
                file_path = self._backend.join(self._step_dir(step), name)
                with contextlib.suppress(Exception):  # an unlisted leftover; retention's later
                    self._backend.delete_file(file_path)

    def _refuse_committed(self, step: int) -> None:
        if self.is_committed(step):
            raise CheckpointExistsError(
                f"Checkpoint step {step} is already committed under {self.safe_url!r}; "
                "committed checkpoints are never overwritten."
            )

    def write_note(self, step: int, name: str, data: bytes) -> None:
        """A small uncommitted file that appears whole or not at all (a rank's report to the
        committer, read while other writers work). Written once, like every file under a step:
        the same bytes again are success, other bytes :class:`FileConflictError`."""
        path = self._backend.join(self._step_dir(step), check_file_name(name))
        what = f"write {step_dir_name(step)}/{name}"
        if self._call(what, lambda: self._backend.create(path, data)):
            return
        if (
            self._call(f"read {step_dir_name(step)}/{name}", lambda: self._backend.read(path))
            != data
        ):
            raise FileConflictError(
                f"{step_dir_name(step)}/{name} under {self.safe_url!r} already exists with other "
                f"contents; a checkpoint's files are written once, so it was left as it was: step "
                f"{step} was saved twice with different contents."
            )
