"""Where a checkpoint's files live under the root URL, and the manifest schema.

    <root>/step-000000001200/state.pt        payload files, written first
    <root>/step-000000001200/manifest.json   commit marker, written last

A step directory without a parseable manifest is not a checkpoint.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

from storage.errors import CheckpointCorruptError, NewerFormatError
from storage.hashing import ALGORITHMS, DEFAULT_ALGORITHM

MANIFEST_NAME = "manifest.json"
FENCE_NAME = "fence.json"  # at the root: the newest writer generation; older writers may not commit
HISTORY_DIR = "events"  # at the root: the run's event history (``run_files``)
FORMAT_VERSION = 1

_STEP_DIR = re.compile(r"^step-(\d{12})$")


def check_file_name(name: str) -> str:
    """A payload file name must stay inside its step directory: no paths, '..' or URL schemes."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or name == MANIFEST_NAME
        or any(c in name for c in "/\\:")
        or name.startswith(".")
    ):
        raise ValueError(f"unsafe payload file name {name!r}: only plain file names are allowed")
    return name


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"Checkpoint step must be >= 0, got {step}.")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory's base name, or None for anything else."""
    m = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str
    """The file's hash; with ``block_size``, the hash of its blocks' digests."""
    block_size: int = 0
    """0: hashed whole. Else hashed in blocks of this many bytes (a shard), so any byte range of it
    can be verified alone against the block digests its checkpoint's index records."""
    algorithm: str = DEFAULT_ALGORITHM
    """``storage.hashing.ALGORITHMS``; in the manifest, the key the checksum is recorded under
    (``{"size": 10, "xxh3": "..."}``), so manifests written with sha256 keep verifying."""

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"size": self.size, self.algorithm: self.checksum}
        if self.block_size:
            doc["block_size"] = self.block_size
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> FileEntry:
        found = [name for name in ALGORITHMS if name in doc]
        if len(found) != 1:
            raise ValueError(f"a file entry needs one checksum of {sorted(ALGORITHMS)}: {doc}")
        return cls(
            size=int(doc["size"]),
            checksum=str(doc[found[0]]),
            block_size=int(doc.get("block_size", 0)),
            algorithm=found[0],
        )


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds. ``metadata`` is the runner's (JSON only, never pickle)."""

    step: int
    files: dict[str, FileEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    generation: int = 0
    """The writer's generation: "latest" orders by (generation, step), so a stale writer that
    commits late never outranks the current generation."""
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        # Field by field, not ``asdict``: its deep copy of W file entries was a sixth of a commit's
        # time at W = 8,192 (bench scale).
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "files"}
        doc["files"] = {name: entry.to_doc() for name, entry in self.files.items()}
        # For people and tools reading the file; verification goes by each entry's own key.
        doc["checksum_algorithm"] = ",".join(sorted({e.algorithm for e in self.files.values()}))
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(raw)
            version = doc.get("format_version")
            if isinstance(version, int) and version > FORMAT_VERSION:
                raise NewerFormatError(
                    f"Checkpoint {where} is in format {version}, newer than this elastictrain "
                    f"reads (format {FORMAT_VERSION}): it was written by a later release. Nothing "
                    "was loaded, skipped or deleted. Upgrade elastictrain to resume it, or point "
                    "--checkpoint-dir elsewhere to start a new run."
                )
            if version != FORMAT_VERSION:
                raise ValueError(f"unsupported format_version {version!r}")
            files = {
                check_file_name(name): FileEntry.from_doc(e) for name, e in doc["files"].items()
            }
            return cls(
                step=int(doc["step"]),
                files=files,
                metadata=dict(doc.get("metadata", {})),
                generation=int(doc.get("generation", 0)),
                created_at=float(doc["created_at"]),
                format_version=FORMAT_VERSION,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(f"Manifest {where} is unreadable: {e}.") from e
