"""Where the repository is, for tests that launch its modules and examples."""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def checkpoint_files(root: str) -> dict[str, bytes]:
    """Every file under a checkpoint location by relative path, except the run's history
    (events/), which grows with every start: what "nothing was changed" compares."""
    out = {}
    for folder, _, names in os.walk(root):
        if os.path.relpath(folder, root).split(os.sep)[0] == "events":
            continue
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.relpath(os.path.join(folder, name), root)] = f.read()
    return out


def flip_a_byte(path: str) -> None:
    """Flip one bit of a byte a third of the way into ``path`` (inside a shard's tensor bytes)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
