"""The run's own files beside its checkpoints: its history and the node check's markers.

    <root>/events/g<generation>-s<seq>.jsonl     rank 0's event log, one segment per flush
    <root>/events/exit-g<generation>-r<rank>-<ns>.jsonl   any rank's last words
    <root>/node-check-g<generation>.json         multi-node starts: rank 0's marker, read back
                                                 by every node, then deleted

Each is written whole (atomically) under a name no other write uses, so a retried write only ever
replaces the same bytes plus newer ones, and readers never see half a segment. Retention and
``ls`` look only at step directories, so none of these is ever taken for a checkpoint.
Mixed into :class:`storage.store.CheckpointStore`.
"""

from __future__ import annotations

from storage.manifest import HISTORY_DIR, check_file_name


class RunFiles:
    """Needs the store's ``_backend`` and ``_call``."""

    def _root_file(self, name: str) -> str:
        return self._backend.join(self._backend.root, check_file_name(name))

    def write_marker(self, name: str, data: bytes) -> None:
        self._call(f"write {name}", lambda: self._backend.write_atomic(self._root_file(name), data))

    def read_marker(self, name: str) -> bytes | None:
        """The marker's bytes, or None when this location has no such file."""
        try:
            return self._call(f"read {name}", lambda: self._backend.read(self._root_file(name)))
        except FileNotFoundError:
            return None

    def delete_marker(self, name: str) -> None:
        self._call(f"delete {name}", lambda: self._backend.delete_file(self._root_file(name)))

    def write_history(self, name: str, data: bytes) -> None:
        path = self._backend.join(self._backend.root, HISTORY_DIR, check_file_name(name))
        self._call(f"write {HISTORY_DIR}/{name}", lambda: self._backend.write_atomic(path, data))

    def read_history(self) -> list[tuple[str, bytes]]:
        """Every history file as (name, bytes), by name; [] when the run has none."""
        where = self._backend.join(self._backend.root, HISTORY_DIR)
        names = self._call(f"list {HISTORY_DIR}", lambda: self._backend.list_names(where))
        out = []
        for name in names:
            if name.startswith("."):  # an atomic write's temporary file, mid-flight
                continue
            path = self._backend.join(where, name)
            try:
                out.append(
                    (
                        name,
                        self._call(
                            f"read {HISTORY_DIR}/{name}", lambda p=path: self._backend.read(p)
                        ),
                    )
                )
            except FileNotFoundError:
                continue
        return out
