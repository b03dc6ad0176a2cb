"""CheckpointStore: commit, list, read-and-verify, pick the latest good one, retention.

Knows nothing of torch or ranks: payloads are named byte strings, metadata is JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from storage.backend import Backend, open_backend
from storage.errors import (
    CheckpointCorruptError,
    StorageError,
    StorageUnavailableError,
)
from storage.hashing import (
    DEFAULT_ALGORITHM,
    check_algorithm,
)
from storage.manifest import (
    FENCE_NAME,
    MANIFEST_NAME,
    Manifest,
    check_file_name,
    parse_step_dir,
    step_dir_name,
)
from storage.probe import probe_location
from storage.publish import Publishing
from storage.retention import partial_steps_to_delete, steps_to_delete
from storage.retry import RetryPolicy
from storage.run_files import RunFiles
from storage.urls import is_local, redact_url
from storage.verified import Checkpoint, VerifiedReads

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _log_corrupt(step: int, error: Exception) -> None:
    logger.error("CORRUPT CHECKPOINT skipped, falling back to an older one: %s", error)


@dataclass(frozen=True)
class ListedCheckpoint:
    """One committed checkpoint as listed; ``error`` is set when it failed verification."""

    step: int
    manifest: Manifest | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class CheckpointStore(Publishing, VerifiedReads, RunFiles):
    """Checkpoints under one root URL. Thread-compatible, not thread-safe."""

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        checksum: str = DEFAULT_ALGORITHM,
    ) -> None:
        """``checksum``: the algorithm new files are hashed with (reads follow each manifest)."""
        self.url = url
        self.checksum = check_algorithm(checksum)
        self.safe_url = redact_url(url)
        self._backend: Backend = open_backend(url, storage_options)
        self._retry = retry or RetryPolicy()

    @property
    def location(self) -> str:
        """Where this process resolved the URL: a local path made absolute (so two hosts' "same"
        relative path can be told apart), else the URL with any credentials removed."""
        return self._backend.root if is_local(self.url) else self.safe_url

    def _step_dir(self, step: int) -> str:
        return self._backend.join(self._backend.root, step_dir_name(step))

    def _call(self, what: str, fn: Callable[[], T], retry: RetryPolicy | None = None) -> T:
        """Run one storage operation with retries; a final non-storage failure is wrapped."""
        try:
            return (retry or self._retry).call(what, fn)
        except (StorageError, FileNotFoundError):
            raise
        except Exception as e:
            raise StorageUnavailableError(
                f"Storage operation '{what}' on {self.safe_url!r} failed: {type(e).__name__}: {e}. "
                "Check that the location exists, is writable, and that credentials/endpoint are right."
            ) from e

    # -- write -------------------------------------------------------------------------------
    def read_fence(self) -> int:
        """The newest writer generation recorded under the root (0 when none)."""
        path = self._backend.join(self._backend.root, FENCE_NAME)
        try:
            raw = self._call("read fence", lambda: self._backend.read(path))
        except FileNotFoundError:
            return 0
        try:
            return int(json.loads(raw)["generation"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointCorruptError(
                f"Fence {FENCE_NAME} under {self.safe_url!r} is unreadable: {e}."
            ) from e

    def advance_fence(self, generation: int) -> int:
        """Claim the store for a new writer generation; returns the generation actually used,
        strictly above every earlier one even if this host's clock runs behind."""
        claimed = max(generation, self.read_fence() + 1)
        path = self._backend.join(self._backend.root, FENCE_NAME)
        body = json.dumps({"generation": claimed, "claimed_at": time.time()}).encode()
        self._call("write fence", lambda: self._backend.write_atomic(path, body))
        return claimed

    def probe(self, deadline_s: float = 10.0, *, write: bool = True) -> None:
        """Write, read back and delete a small object under the root: fail fast on a bad location.
        ``write=False`` (the read-only tools) only proves the root can be listed. Raises
        :class:`StorageNotUsableError` naming the likely cause (see :mod:`storage.probe`)."""
        retry = dataclasses.replace(self._retry, deadline_s=min(deadline_s, self._retry.deadline_s))
        probe_location(
            self._backend,
            lambda what, fn: self._call(what, fn, retry),
            deadline_s=retry.deadline_s,
            safe_url=self.safe_url,
            write=write,
        )

    # -- read --------------------------------------------------------------------------------
    def step_dirs(self) -> list[int]:
        """Every step directory, committed or not (a partial write's too), oldest first."""
        names = self._call("list checkpoints", lambda: self._backend.list_names(self._backend.root))
        return sorted(s for s in (parse_step_dir(n) for n in names) if s is not None)

    def read_manifest(self, step: int) -> Manifest | None:
        """The manifest of ``step``, or None when the step is not committed."""
        path = self._backend.join(self._step_dir(step), MANIFEST_NAME)
        try:
            raw = self._call(f"read manifest of step {step}", lambda: self._backend.read(path))
        except FileNotFoundError:
            return None
        manifest = Manifest.from_json(raw, where=f"{self.safe_url}/{step_dir_name(step)}")
        if manifest.step != step:
            raise CheckpointCorruptError(
                f"Manifest in {step_dir_name(step)} under {self.safe_url!r} says step {manifest.step}."
            )
        return manifest

    def is_committed(self, step: int) -> bool:
        """True when ``step`` has a manifest (not verified)."""
        path = self._backend.join(self._step_dir(step), MANIFEST_NAME)
        return self._call(f"check step {step}", lambda: self._backend.exists(path))

    def committed_steps(self) -> list[int]:
        """Steps that have a manifest (not verified), oldest first."""
        return [step for step in self.step_dirs() if self.is_committed(step)]

    def ranked_manifests(
        self, on_corrupt: Callable[[int, Exception], None] | None = None
    ) -> list[Manifest]:
        """Manifests of committed checkpoints, newest first by (generation, step): the order in
        which "latest" is looked for. An unreadable manifest is reported and left out."""
        ranked = []
        for step in self.committed_steps():
            try:
                manifest = self.read_manifest(step)
            except CheckpointCorruptError as e:
                (on_corrupt or _log_corrupt)(step, e)
                continue
            if manifest is not None:
                ranked.append(manifest)
        return sorted(ranked, key=lambda m: (m.generation, m.step), reverse=True)

    def latest(
        self, on_corrupt: Callable[[int, Exception], None] | None = None
    ) -> Checkpoint | None:
        """The newest committed checkpoint that verifies, ordered by (generation, step); corrupt
        ones are reported (``on_corrupt``, else logged) and skipped."""
        for manifest in self.ranked_manifests(on_corrupt):
            try:
                return self.read(manifest.step)
            except CheckpointCorruptError as e:
                (on_corrupt or _log_corrupt)(manifest.step, e)
        return None

    def list(self, *, verify: bool = True) -> list[ListedCheckpoint]:
        """Committed checkpoints, oldest first, each verified when ``verify``."""
        out = []
        for step in self.committed_steps():
            try:
                manifest = self.read(step).manifest if verify else self.read_manifest(step)
                out.append(ListedCheckpoint(step=step, manifest=manifest))
            except CheckpointCorruptError as e:
                out.append(ListedCheckpoint(step=step, manifest=None, error=str(e)))
        return out

    # -- delete ------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Un-commit ``step`` (manifest first, so no half-deleted checkpoint looks committed)."""
        step_dir = self._step_dir(step)
        self._call(
            f"delete manifest of step {step}",
            lambda: self._backend.delete_file(self._backend.join(step_dir, MANIFEST_NAME)),
        )
        self._call(f"delete step {step}", lambda: self._backend.delete_tree(step_dir))

    def uncommit(self, step: int) -> None:
        """Delete only the manifest of ``step``: its files stay until retention removes the
        directory (other writers may be adding this generation's files to it right now)."""
        path = self._backend.join(self._step_dir(step), MANIFEST_NAME)
        self._call(f"delete manifest of step {step}", lambda: self._backend.delete_file(path))

    def read_uncommitted(self, step: int, name: str) -> bytes | None:
        """A file another writer put under ``step`` before any commit (unverified), or None."""
        path = self._backend.join(self._step_dir(step), check_file_name(name))
        try:
            return self._call(
                f"read {step_dir_name(step)}/{name}", lambda: self._backend.read(path)
            )
        except FileNotFoundError:
            return None

    def names_in(self, step: int) -> set[str]:
        """The file names under ``step``'s directory, committed or not."""
        step_dir = self._step_dir(step)
        return set(
            self._call(f"list {step_dir_name(step)}", lambda: self._backend.list_names(step_dir))
        )

    def retention_plan(
        self, keep_last: int, newest_good: int, keep_every: int | None = None
    ) -> list[int]:
        """Steps retention would delete: committed ones beyond the policy, and partial leftovers
        older than ``newest_good`` (the newest step that verifies)."""
        committed = self.committed_steps()
        doomed = steps_to_delete(committed, keep_last, newest_good, keep_every)
        partial = partial_steps_to_delete(self.step_dirs(), committed, newest_good)
        return sorted(set(doomed + partial))

    def apply_retention(
        self, keep_last: int, newest_good: int, keep_every: int | None = None
    ) -> list[int]:
        """Apply the retention policy; returns the steps actually deleted.

        A failed deletion is logged and skipped (the next retention retries it): cleaning up must
        never stop training.
        """
        deleted = []
        for step in self.retention_plan(keep_last, newest_good, keep_every):
            try:
                self.delete(step)
                deleted.append(step)
            except Exception as e:  # noqa: BLE001 - see docstring
                logger.warning(
                    "retention: could not delete step %d under %s: %s; will retry later",
                    step,
                    self.safe_url,
                    e,
                )
        if deleted:  # the caller says it where a person should see it (the commit line)
            logger.debug("retention: deleted checkpoint steps %s under %s", deleted, self.safe_url)
        return deleted
