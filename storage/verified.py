"""Reading committed checkpoints back, trusting nothing: whole files checked against the manifest,
byte ranges checked block by block, and the cheap size check that catches a missing or truncated
file before anyone reads. Mixed into :class:`storage.store.CheckpointStore`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from storage.errors import CheckpointCorruptError, CheckpointNotFoundError
from storage.hashing import block_root, hash_stream, read_hashed
from storage.manifest import FileEntry, Manifest, check_file_name, step_dir_name
from storage.ranges import Range, read_verified

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint whose files were read and verified against its manifest."""

    manifest: Manifest
    files: dict[str, bytes | memoryview]
    """Small files as bytes; big ones as writable memoryviews (tensors may be views into them)."""


class VerifiedReads:
    """Needs the store's ``_backend``, ``_call``, ``_step_dir``, ``safe_url``, ``read_manifest``
    and ``committed_steps``."""

    def read(self, step: int) -> Checkpoint:
        """Read ``step`` and verify every file's size and checksum against its manifest."""
        manifest = self.read_manifest(step)
        if manifest is None:
            raise CheckpointNotFoundError(
                f"No committed checkpoint at step {step} under {self.safe_url!r} "
                f"(committed steps: {self.committed_steps() or 'none'})."
            )
        files: dict[str, bytes | memoryview] = {}
        for name, entry in manifest.files.items():
            data = self._read_verified(step, name, entry)
            files[name] = data
        return Checkpoint(manifest=manifest, files=files)

    def _read_verified(self, step: int, name: str, entry: FileEntry) -> bytes:
        """One payload file, checked against its manifest entry. A mismatch is read a second
        time before it is called corruption: a flaky network must never get a good checkpoint
        skipped (or replaced)."""
        path = self._backend.join(self._step_dir(step), name)
        problem = ""
        for attempt in range(2):
            try:
                data, digest = self._call(
                    f"read {step_dir_name(step)}/{name}",
                    lambda: read_hashed(
                        self._backend, path, entry.size, entry.block_size, entry.algorithm
                    ),
                )
            except FileNotFoundError as e:
                raise CheckpointCorruptError(
                    f"Checkpoint step {step} under {self.safe_url!r}: file {name!r} is missing."
                ) from e
            if len(data) != entry.size:
                problem = (
                    f"has {len(data)} bytes, manifest says {entry.size} (truncated or overwritten)"
                )
            elif digest != entry.checksum:
                problem = (
                    f"{entry.algorithm} {digest[:16]}... does not match manifest "
                    f"{entry.checksum[:16]}... "
                    "(corrupted)"
                )
            else:
                if attempt:
                    logger.warning(
                        "step %d file %s verified on a second read (the first %s)",
                        step,
                        name,
                        problem,
                    )
                return data
        raise CheckpointCorruptError(
            f"Checkpoint step {step} under {self.safe_url!r}: file {name!r} {problem}, twice."
        )

    def check_file(self, manifest: Manifest, name: str) -> None:
        """Verify one file of a committed checkpoint against ``manifest`` without holding it: one
        streamed read in constant memory. A reader that then opens it (:meth:`open_file`) reads
        bytes that verified, since committed files are never rewritten. Raises
        CheckpointCorruptError."""
        entry, step = manifest.files[name], manifest.step
        path = self._backend.join(self._step_dir(step), name)
        try:
            size, root = self._call(
                f"hash {step_dir_name(step)}/{name}",
                lambda: hash_stream(self._backend, path, entry.block_size, entry.algorithm),
            )
        except FileNotFoundError as e:
            raise CheckpointCorruptError(
                f"Checkpoint step {step} under {self.safe_url!r}: file {name!r} is missing."
            ) from e
        if size != entry.size or root != entry.checksum:
            problem = (
                f"has {size} bytes, manifest says {entry.size}"
                if size != entry.size
                else f"{entry.algorithm} {root[:16]}... does not match manifest {entry.checksum[:16]}..."
            )
            raise CheckpointCorruptError(
                f"Checkpoint step {step} under {self.safe_url!r}: file {name!r} {problem}."
            )

    def open_file(self, step: int, name: str):
        """An unverified, random-access file object for one payload file (for cheap inspection)."""
        check_file_name(name)
        return self._backend.open_read(self._backend.join(self._step_dir(step), name))

    def read_file(self, manifest: Manifest, name: str) -> bytes | memoryview:
        """One file of a committed checkpoint, verified against ``manifest``."""
        return self._read_verified(manifest.step, name, manifest.files[name])

    def read_ranges(
        self, manifest: Manifest, name: str, blocks: list[str], ranges: list[Range]
    ) -> tuple[dict[Range, memoryview], int]:
        """Byte ranges of one block-hashed file of a committed checkpoint, each checked block by
        block against ``blocks`` (its block digests, from wherever the writer kept them: they are
        checked first against the file's recorded hash, which is their SHA-256). A view per range
        and the bytes read. Raises CheckpointCorruptError on a mismatch a second read confirms."""
        entry, step = manifest.files[name], manifest.step
        path = self._backend.join(self._step_dir(step), name)

        def fail(problem: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(
                f"Checkpoint step {step} under {self.safe_url!r}: file {name!r}: {problem}."
            )

        if not entry.block_size:
            raise ValueError(f"{name} of step {step} is not block-hashed; read it whole")
        if block_root(blocks, entry.algorithm) != entry.checksum:
            raise fail("its block digests do not match its recorded hash")

        def read(start: int, end: int) -> bytes:
            try:
                return self._call(
                    f"read {step_dir_name(step)}/{name}[{start}:{end}]",
                    lambda: self._backend.read_range(path, start, end),
                )
            except FileNotFoundError as e:
                raise fail("missing") from e

        return read_verified(
            read,
            ranges,
            size=entry.size,
            block_size=entry.block_size,
            blocks=blocks,
            fail=fail,
            algorithm=entry.algorithm,
        )

    def check_sizes(self, manifest: Manifest) -> None:
        """Every file of a committed checkpoint is there with its recorded size: the cheap check
        that catches a deleted or truncated shard before anyone reads. One listing of the step
        (paged by the server: one request per 1,000 objects on S3), not one request per file,
        so its cost does not grow with the number of ranks that wrote shards. Raises
        CheckpointCorruptError."""
        step_dir = self._step_dir(manifest.step)
        sizes = self._call(
            f"list {step_dir_name(manifest.step)}", lambda: self._backend.list_sizes(step_dir)
        )
        for name, entry in manifest.files.items():
            size = sizes.get(name)
            if size != entry.size:
                found = "missing" if size is None else f"{size} bytes, manifest says {entry.size}"
                raise CheckpointCorruptError(
                    f"Checkpoint step {manifest.step} under {self.safe_url!r}: file {name!r} is "
                    f"{found}."
                )
