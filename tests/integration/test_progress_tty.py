"""On a real terminal (a pty), rank 0 draws a live status line and the other ranks stay quiet."""

from __future__ import annotations

import contextlib
import os
import pty
import signal
import subprocess
import sys
import time

from tests.helpers.launcher import descendants, job_env


def test_live_progress_on_a_terminal_and_quiet_other_ranks(tmp_path):
    controller, terminal = pty.openpty()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "elastictrain", "--checkpoint-dir", str(tmp_path / "ckpt"), "--max-steps", "150"]
    cmd += ["--checkpoint-every-steps", "50", "--task-option", "step_time=0.01"]
    proc = subprocess.Popen(
        cmd,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        cwd=tmp_path,
        env=job_env(TERM="xterm", COLUMNS="200"),
        start_new_session=True,
    )
    os.close(terminal)
    out = b""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=30) == 0, out.decode(errors="replace")[-3000:]
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:  # only what this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        os.close(controller)
    text = out.decode(errors="replace")
    redraws = text.count("\r\x1b[Kstep ")
    assert redraws >= 2, text[-3000:]  # redrawn in place, several times
    assert "steps/s | ETA" in text and "step 150/150 [##########] 100.0%" in text
    assert "ckpt 100" in text and "world 2" in text
    assert "FINISHED 150 steps" in text  # log records still print, above the status line
    assert "progress 150/150" not in text  # the periodic plain line is for logs, not terminals
    assert "INFO [rank 1 |" not in text  # the other ranks only speak when something is wrong
