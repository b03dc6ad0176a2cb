"""Every Python stack of a hung job, for the failure message: a hang that passes alone and shows
up under a loaded suite leaves nothing else behind (its log may be empty). ``py-spy dump`` reads
each process from outside, so a rank stuck in a C++ collective is shown as well as one in Python.
"""

from __future__ import annotations

import shutil
import subprocess

from elastictrain.tools.chaos import descendants

LIMIT = 2500  # characters per process: the CI shows a failure's message, not the whole log


def dump(root_pid: int) -> str:
    """``py-spy dump`` of ``root_pid`` and every process under it ("" where py-spy is missing)."""
    spy = shutil.which("py-spy")
    if spy is None:
        return ""
    parts = []
    for pid in [root_pid, *descendants(root_pid)]:
        try:
            out = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20
            )
        except subprocess.TimeoutExpired:
            parts.append(f"pid {pid}: py-spy timed out")
            continue
        text = (out.stdout or out.stderr).strip()
        parts.append(text if len(text) <= LIMIT else text[:LIMIT] + "\n  ...")
    return "\n".join(parts)
