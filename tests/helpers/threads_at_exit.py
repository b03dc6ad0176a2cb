"""Which threads each process of a job still runs as the interpreter finalizes.

Why: a thread still inside a C++ store request then aborts the process if the request returns
during finalization ("terminate called without an active exception", SIGABRT; torchrun counts a
failure after a clean finish). The abort is rare (a CI run in tens), so a test asserts its cause
instead: no thread of elastictrain's left when the process exits.
"""

from __future__ import annotations

import ast
import os
import re

_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_threads")
_OURS = ("elastictrain-", "storage-")  # every thread the runner and its storage start
_LINE = re.compile(r"^THREADS AT EXIT pid=(\d+) (\[.*\])$", re.M)


def env(base: dict[str, str]) -> dict[str, str]:
    """``base`` (a job's environment) with the report loaded into every Python process."""
    path = os.pathsep.join(filter(None, [_SITE, base.get("PYTHONPATH")]))
    return {**base, "PYTHONPATH": path}


def ours_left(log: str) -> tuple[int, dict[int, list[str]]]:
    """How many processes reported, and those whose exit left an elastictrain thread running
    (pid: thread names)."""
    reports = [(int(pid), ast.literal_eval(names)) for pid, names in _LINE.findall(log)]
    left = {pid: names for pid, names in reports if any(n.startswith(_OURS) for n in names)}
    return len(reports), left
