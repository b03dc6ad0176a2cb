"""Starting the benches' child jobs, and the I/O helpers they share."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from elastictrain.observe.events import Event
from elastictrain.tools.chaos import descendants

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def drop_cache(path: str) -> None:
    """Evict a local file's pages so the next read comes from the device, not memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a bench's child job: one thread per process, as under torchrun, and
    this checkout importable (``-m elastictrain`` runs the code being measured)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
        **extra,
    }


def torchrun(*args: str, nproc: int = 2, max_restarts: int | None = None) -> list[str]:
    """The command line of a one-node ``torchrun --standalone`` job of ``nproc`` workers."""
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts is not None else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *restarts,
        *args,
    ]


def toy_job_args(ckpt: str, ev: str, size: int) -> list[str]:
    """The toy task's job with about ``size`` bytes of state, checkpointing every 20 steps."""
    layers = max(1, round(size / (8 * 1024 * 1024)))  # weights + momentum of 1024x1024 fp32 layers
    return [
        "-m",
        "elastictrain",
        "--checkpoint-dir",
        ckpt,
        "--event-log",
        ev,
        "--max-steps",
        "1000000",
        "--checkpoint-every-steps",
        "20",
        "--task-option",
        "hidden=1024",
        "--task-option",
        f"layers={layers}",
        "--task-option",
        "batch_size=32",
    ]


class Torchrun:
    """One torchrun agent in its own session, its output in ``log``; only it and its descendants
    are ever signalled."""

    def __init__(
        self,
        args: list[str],
        log: str,
        env: dict[str, str],
        nproc: int = 2,
        command: list[str] | None = None,
    ) -> None:
        """``command``: the whole command line (a multi-node agent), instead of a standalone
        torchrun of ``args``."""
        self.log_path = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                command or torchrun(*args, nproc=nproc, max_restarts=3),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def workers(self) -> dict[int, int]:
        out, todo = {}, [self.proc.pid]
        children: dict[int, list[int]] = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
        while todo:
            for child in children.get(todo.pop(), []):
                todo.append(child)
                with contextlib.suppress(OSError):
                    with open(f"/proc/{child}/environ", "rb") as f:
                        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                    if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
                        out[int(env[b"RANK"])] = child
        return out

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        # Every descendant: under --replace-in-place the supervisors' children are in process
        # groups of their own, out of the agent's session group's reach.
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, job: Torchrun) -> Any:
    """The first true value of ``predicate()``, polled; raises when the job exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job.proc.poll() is not None:
            raise RuntimeError(f"torchrun exited waiting for {what}:\n{job.log()[-3000:]}")
        time.sleep(0.01)
    raise RuntimeError(f"{what} not seen within {timeout}s:\n{job.log()[-3000:]}")


def events_in(path: str) -> list[dict[str, Any]]:
    from elastictrain.observe.events import read_events

    return read_events(path) if os.path.exists(path) else []


def first_step_after(ev: str, t: float, timeout: float, what: str, job: Torchrun) -> dict[str, Any]:
    """The first ``first_step`` event in ``ev`` after time ``t`` (a kill, a launch)."""
    return wait_for(
        lambda: [e for e in events_in(ev) if e["event"] == Event.FIRST_STEP and e["time"] > t],
        timeout,
        what,
        job,
    )[0]
