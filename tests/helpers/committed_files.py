"""The write-once invariant, checked from outside while a job runs (docs/checkpoints.md,
"Write-once"): a file a committed manifest lists never changes, and never goes while that manifest
is still there.

    with CommittedFiles(tmp_path, tier_folder) as files:
        ...run, kill, resume...
    files.check()  # raises AssertionError naming every violation

or, in a test too long to indent, the ``committed_files`` fixture (tests/conftest.py): it starts
one and stops it at teardown, whatever happened.

A thread in the test's own process walks the folders every ``interval_s``. Each manifest it finds
under a ``step-*`` folder (the durable tier, the node tier's copies, its peer copies) is read
once: every file it lists must then have the size and checksum the manifest records, and its
inode, size and modification time are kept. Every later look compares them: a file rewritten in
place (a truncating open changes its size or mtime), replaced by another inode, or gone while its
manifest still stands (retention removes the manifest first) is a violation. A manifest may be
replaced only by a newer generation's. At the end every file still listed is hashed once more,
which catches other bytes written within one tick of the file system's clock (same size, same
mtime); the same bytes written again within that tick are the one rewrite it cannot see.

A test that damages a committed file on purpose says so first: ``files.damaged(path)``.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

from storage.local import LocalBackend
from storage.manifest import MANIFEST_NAME, FileEntry, parse_step_dir


@dataclass
class _Seen:
    manifest_id: tuple[int, int]
    """The manifest's (inode, mtime_ns) when its files were recorded."""
    generation: int
    files: dict[str, tuple[int, int, int]]
    """name -> (inode, size, mtime_ns)."""
    entries: dict[str, FileEntry]


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _hash(path: str, entry: FileEntry) -> tuple[int, str]:
    from storage.hashing import hash_stream

    return hash_stream(LocalBackend(os.path.dirname(path)), path, entry.block_size, entry.algorithm)


class CommittedFiles:
    def __init__(self, *roots, interval_s: float = 0.1) -> None:
        self.roots = [str(r) for r in roots]
        self.interval_s = interval_s
        self.violations: list[str] = []
        self.manifests_seen = 0
        self._seen: dict[str, _Seen] = {}
        self._damaged: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="committed-files", daemon=True)

    def start(self) -> CommittedFiles:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The last look and the re-hash (once; ``check`` calls it)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.look()
        self._rehash()

    def __enter__(self) -> CommittedFiles:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def damaged(self, path: str) -> None:
        """The test is about to damage ``path`` on purpose: it is no longer watched."""
        with self._lock:
            self._damaged.add(os.path.realpath(path))

    def check(self) -> None:
        """Stop watching; raise AssertionError naming every violation seen."""
        self.stop()
        assert not self.violations, "committed files changed:\n" + "\n".join(self.violations)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.look()

    def _manifests(self) -> list[str]:
        found = []
        for root in self.roots:
            for folder, dirs, names in os.walk(root):
                if MANIFEST_NAME in names and parse_step_dir(folder) is not None:
                    found.append(os.path.join(folder, MANIFEST_NAME))
                dirs[:] = [d for d in dirs if not d.startswith(".")]
        return found

    def look(self) -> None:
        """One pass: record manifests seen for the first time, compare every recorded file."""
        with self._lock:
            for path in self._manifests():
                self._look_at(path)
            for path in [p for p in self._seen if _stat(p) is None]:
                self._gone(path)

    def _look_at(self, manifest_path: str) -> None:
        stat = _stat(manifest_path)
        if stat is None:
            return
        seen = self._seen.get(manifest_path)
        if seen is not None and seen.manifest_id == (stat[0], stat[2]):
            self._compare(manifest_path, seen)
            return
        try:
            with open(manifest_path, "rb") as f:
                doc = json.loads(f.read())
            entries = {name: FileEntry.from_doc(e) for name, e in doc["files"].items()}
        except (OSError, ValueError, KeyError) as e:
            self.violations.append(f"{manifest_path}: a committed manifest is unreadable: {e}")
            return
        generation = int(doc.get("generation", 0))
        if seen is not None:
            self._gone(manifest_path)  # the old one's files may go now, after the swap
            if generation <= seen.generation:
                self.violations.append(
                    f"{manifest_path}: rewritten by generation {generation}, not newer than the "
                    f"{seen.generation} it replaced"
                )
        folder = os.path.dirname(manifest_path)
        files = {}
        for name, entry in entries.items():
            path = os.path.join(folder, name)
            if os.path.realpath(path) in self._damaged:
                continue
            before = _stat(path)
            try:
                matches = before is not None and _hash(path, entry) == (entry.size, entry.checksum)
            except FileNotFoundError:
                matches = False
            if not matches:
                if _stat(manifest_path) != stat:
                    return  # un-committed or replaced meanwhile (retention): nothing to record
                problem = "missing" if before is None else "does not match its manifest"
                self.violations.append(f"{path}: {problem} when its commit was first seen")
                continue
            files[name] = before
        self.manifests_seen += 1
        self._seen[manifest_path] = _Seen((stat[0], stat[2]), generation, files, entries)

    def _compare(self, manifest_path: str, seen: _Seen) -> None:
        folder = os.path.dirname(manifest_path)
        for name, before in list(seen.files.items()):
            path = os.path.join(folder, name)
            if os.path.realpath(path) in self._damaged:
                del seen.files[name]
                continue
            now = _stat(path)
            if now == before:
                continue
            still = _stat(manifest_path)
            if still is None or (still[0], still[2]) != seen.manifest_id:
                return  # un-committed or replaced since: its files may go
            what = "deleted" if now is None else "rewritten"
            self.violations.append(f"{path}: {what} while its manifest still lists it")
            del seen.files[name]

    def _gone(self, manifest_path: str) -> None:
        self._seen.pop(manifest_path, None)

    def _rehash(self) -> None:
        for manifest_path, seen in self._seen.items():
            folder = os.path.dirname(manifest_path)
            for name in seen.files:
                path = os.path.join(folder, name)
                entry = seen.entries[name]
                if os.path.realpath(path) in self._damaged or _stat(path) is None:
                    continue
                if _hash(path, entry) != (entry.size, entry.checksum):
                    self.violations.append(f"{path}: its bytes changed by the end of the run")


def tier_folder(checkpoint_dir: str) -> str:
    """The node tier's folder of a job checkpointing to ``checkpoint_dir`` on this host (the
    tests' own root under /dev/shm, conftest's ``ELASTICTRAIN_LOCAL_ROOT``)."""
    from elastictrain import knobs
    from elastictrain.checkpoint.tiers.local import default_dir

    return default_dir(checkpoint_dir, knobs.local_tier_root())
