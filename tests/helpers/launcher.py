"""Launch real torchrun jobs and break them the way a cluster would.

Only processes we started are ever signalled: the agent's pid and its descendants, found by
walking /proc (torchrun starts workers in their own sessions, so a process group is not enough).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from elastictrain.observe.events import read_events
from elastictrain.tools.chaos import descendants
from storage.manifest import MANIFEST_NAME, parse_step_dir, step_dir_name
from tests.helpers import stacks
from tests.helpers.paths import REPO_ROOT


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")])),
    )
    env.update(extra)
    return env


TWO_NODES = ["bash", os.path.join(REPO_ROOT, "examples", "two_nodes.sh")]
"""The two-node recipe: one simulated node per launch, chosen by ``node_env``."""


def node_env(node: int, port: int, run_id: str, ckpt: str, **extra: str) -> dict[str, str]:
    """The environment of node ``node`` of ``TWO_NODES``."""
    return job_env(NODE=str(node), PORT=str(port), RUN_ID=run_id, CKPT=ckpt, **extra)


RDZV_TEST_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
"""The recipe's short demo timings: a lost agent is dropped in about 3 s."""


@contextlib.contextmanager
def store_server(port: int) -> Iterator[subprocess.Popen]:
    """A TCPStore server in a process of its own on ``port``, up once this yields: torchrun's
    rendezvous store off every simulated node (a small CPU host beside the job), or any store a
    test freezes (SIGSTOP keeps its socket open, as a hung host's)."""
    code = (
        "import sys, time, torch.distributed as d; "
        "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False); "
        "print('up', flush=True); time.sleep(1e9)"
    )
    server = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"up"
        yield server
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()


def off_node_agent(nnodes: str, port: int, run_id: str, nproc: int = 1) -> list[str]:
    """torchrun's flags for one simulated node of a job whose rendezvous store runs off the
    nodes, at 127.0.0.1:``port`` (``store_server``), so every agent uses ``is_host=0``."""
    return [
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc}",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={RDZV_TEST_CONF},is_host=0",
    ]


TORCHRUN_MODULE = "torch.distributed.run"
TORCHRUN = (
    f"import gc; gc.disable(); from {TORCHRUN_MODULE} import main; gc.freeze(); gc.enable(); main()"
)
"""A ``--standalone`` torchrun agent: the same ``main`` the ``torchrun`` command runs, with Python's
cyclic garbage collector paused while torch imports and the imported objects frozen before it
starts. The suite is CPU-bound on 2 cores and starts about 100 such agents: while torch's
import-time objects are created the collector scans them again and again, and once more at exit,
0.5 of an agent's 1.7 s of CPU here (``torchrun --help``, measured both ways). The agent's code,
flags, process tree and signals are torchrun's; ``elastictrain.__main__`` does the same for the
training processes. Given with ``-c`` so that the agent's own traceback (a Ctrl-C) names no file
of this repository, as tests check of the workers'. The recipes users run (``examples/*.sh``)
call ``torchrun`` itself."""


class Job:
    """One ``torchrun`` agent (a simulated node) and everything it spawns."""

    def __init__(
        self,
        torchrun_args: list[str],
        app_args: list[str],
        log_path: str,
        cwd: str,
        env: dict[str, str] | None = None,
        entry: tuple[str, ...] = ("-m", "elastictrain"),
    ) -> None:
        """``entry``: what torchrun runs (default the runner; a script path for library mode)."""
        # A multi-node agent's workers read its command line for the rendezvous store
        # (``cluster.env.rendezvous_store``): those agents keep torchrun's own module name.
        agent = ["-c", TORCHRUN] if "--standalone" in torchrun_args else ["-m", TORCHRUN_MODULE]
        cmd = [sys.executable, *agent, *torchrun_args, *entry, *app_args]
        self._start(cmd, log_path, cwd, env)

    @classmethod
    def wrapping(
        cls, command: list[str], log_path: str, cwd: str, env: dict[str, str] | None = None
    ) -> Job:
        """A launch script (an sbatch file, a shell recipe) that starts torchrun itself."""
        job = cls.__new__(cls)
        job._start(command, log_path, cwd, env)
        return job

    def _start(self, cmd: list[str], log_path: str, cwd: str, env: dict[str, str] | None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in kill()/wait()
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env or job_env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def workers(self) -> dict[int, int]:
        """Live worker pids by global rank (not their DataLoader workers, which inherit the
        environment: a rank's process is the one whose parent is not a rank's process)."""
        ranked = {}
        for pid in descendants(self.proc.pid):
            env = _environ(pid)
            if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
                ranked[pid] = int(env["RANK"])
        return {rank: pid for pid, rank in ranked.items() if _parent(pid) not in ranked}

    def kill_worker(self, rank: int, sig: int = signal.SIGKILL, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.workers().get(rank)
            if pid is not None:
                os.kill(pid, sig)
                return pid
            time.sleep(0.05)
        raise AssertionError(
            f"no worker with rank {rank} appeared within {timeout}s; log:\n{self.log()}"
        )

    def kill_training_process(self, events: str, rank: int, epoch: int) -> int:
        """Under --replace-in-place the process torchrun started is a supervisor: SIGKILL
        ``rank``'s training process of membership epoch ``epoch`` (0-based: the start events
        name each epoch's processes). Its pid."""
        starts = [e for e in read_events(events) if e["event"] == "start"]
        pid = starts[epoch]["processes"][rank][1]
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            where = stacks.dump(self.proc.pid)  # before the kill: where each process hangs
            self.kill()
            raise AssertionError(
                f"torchrun did not finish within {timeout}s; log tail:\n{self.log()[-4000:]}"
                f"\nstacks:\n{where}"
            ) from None
        finally:
            self._log.close()

    def signal_node(self, sig: int) -> list[int]:
        """``sig`` to the agent and every process under it: SIGSTOP is a frozen host (its
        sockets stay open), SIGCONT its thaw. The pids signalled."""
        pids = [self.proc.pid, *descendants(self.proc.pid)] if self.proc.poll() is None else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def kill(self) -> None:
        """SIGKILL the agent and all of its descendants (a node failure)."""
        for _ in range(3):  # a dying agent may be spawning; sweep until nothing is left
            pids = [self.proc.pid, *descendants(self.proc.pid)] if self.proc.poll() is None else []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not pids:
                break
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def wait_for_spares(job, rank: int, n: int) -> None:
    """Until ``rank`` has had ``n`` spares ready (imported and built): a kill before its spare is
    ready (seconds, on a loaded machine) is a different case, a rank back too late."""
    deadline = time.monotonic() + 120
    while job.log().count(f"spare for rank {rank} ready") < n:
        assert time.monotonic() < deadline and job.proc.poll() is None, job.log()[-3000:]
        time.sleep(0.1)


class _Tail:
    """One event log as read so far: a poll parses only the lines appended since the last."""

    def __init__(self, inode: int = 0) -> None:
        self.inode, self.offset = inode, 0
        self.events: list[dict[str, Any]] = []


_TAILS: dict[str, _Tail] = {}


def events_so_far(path: str) -> list[dict[str, Any]]:
    """``read_events(path)``, incrementally: the tests poll their jobs' logs 20 times a second
    for minutes, and parsing the whole file each time was a few per cent of a core per waiting
    test. A torn last line waits for its newline; a line torn by a kill, then appended to, is
    skipped, as ``read_events`` skips it. The list is shared: read it, do not change it."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return []
    tail = _TAILS.get(path)
    if tail is None or tail.inode != stat.st_ino or stat.st_size < tail.offset:
        tail = _TAILS[path] = _Tail(stat.st_ino)
    if stat.st_size > tail.offset:
        with open(path, "rb") as f:
            f.seek(tail.offset)
            chunk = f.read()
        whole = chunk.rfind(b"\n") + 1
        for line in chunk[:whole].splitlines():
            with contextlib.suppress(ValueError):  # json.JSONDecodeError, a torn line
                tail.events.append(json.loads(line))
        tail.offset += whole
    return tail.events


def wait_for_event(
    path: str, predicate: Callable[[dict[str, Any]], bool], timeout: float, job: Job | None = None
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in events_so_far(path):
            if predicate(event):
                return event
        if job is not None and job.proc.poll() is not None:
            raise AssertionError(
                f"job exited with {job.proc.returncode} before the event; log:\n{job.log()[-4000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(f"event not seen within {timeout}s in {path}")


def wait_for_fast_copies(
    tier_dir: str, copies: list[str], durable_dir: str, at_least: int, timeout: float, job: Job
) -> int:
    """Until every copy folder named (``own-r00000``, ``peer-r00002``, ...) under a node's fast
    tier holds one committed step, at least ``at_least`` and of a generation no older than the
    durable tier's step ``at_least``; returns the newest such step. A kill timed by this finds a
    fast step as new as the durable one, whatever pace the background writers kept."""
    with open(os.path.join(durable_dir, step_dir_name(at_least), MANIFEST_NAME)) as f:
        generation = json.load(f)["generation"]

    def committed(folder: str) -> set[int]:
        found = set()
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            manifest = os.path.join(folder, name, MANIFEST_NAME)
            with contextlib.suppress(OSError, ValueError), open(manifest) as f:
                if json.load(f)["generation"] >= generation:
                    found.add(parse_step_dir(name))
        return found

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        common: set[int] | None = None
        for name in copies:
            steps = committed(os.path.join(tier_dir, "shards", name))
            common = steps if common is None else common & steps
        ready = [s for s in common or () if s is not None and s >= at_least]
        if ready:
            return max(ready)
        if job is not None and job.proc.poll() is not None:
            raise AssertionError(
                f"job exited with {job.proc.returncode}; log:\n{job.log()[-4000:]}"
            )
        time.sleep(0.02)
    raise AssertionError(f"no common fast copy >= step {at_least} of {copies} within {timeout}s")


def final_state(url: str, **kw: Any) -> dict[str, Any]:
    from elastictrain import load_checkpoint

    return load_checkpoint(url, **kw)


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Model, optimizer and scheduler state identical bit for bit."""
    assert a["progress"] == b["progress"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"model[{k}] differs"
    _assert_tree_equal(a["optimizer"], b["optimizer"], "optimizer")
    assert a["scheduler"] == b["scheduler"]


def _assert_tree_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where} keys differ"
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{where}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_tree_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def toy_args(
    ckpt: str,
    events: str,
    *,
    max_steps: int = 300,
    every: int = 40,
    step_time: float = 0.01,
    extra: tuple[str, ...] = (),
) -> list[str]:
    return [
        "--checkpoint-dir",
        ckpt,
        "--event-log",
        events,
        "--max-steps",
        str(max_steps),
        "--checkpoint-every-steps",
        str(every),
        "--log-every-seconds",
        "1",
        "--task-option",
        f"step_time={step_time}",
        *extra,
    ]


def run_single(
    args: list[str], cwd: str, timeout: float = 120, module: str = "elastictrain"
) -> subprocess.CompletedProcess:
    """``python -m elastictrain ARGS`` without torchrun: a training run of one process (world
    size 1), or a tool (``ls``, ``bench``, ``chaos``, ...); ``module``: another module's main."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
