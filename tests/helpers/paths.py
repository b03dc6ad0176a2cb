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
