"""``python -m elastictrain chaos [options] -- torchrun ...``: break a job the way a cluster does.

Launches the command in its own session, injects faults into it, waits for it to end, and prints a
timeline: each fault with its target pid, the job's exit code and the total time. It succeeds (exit
0) when the job finished (exit 0) in spite of the faults. Only processes it started are ever
signalled, found by walking /proc from the agent it launched: torchrun starts its workers in
sessions of their own, so a process group would miss them.

Faults:
  kill-worker  SIGKILL one worker (an OOM kill, a segfault)
  stop-worker  SIGSTOP one worker (a hung rank); it is sent SIGCONT when the job ends
  slow-worker  slow one worker by --slow-factor (a throttled CPU, a noisy neighbour): it is stopped
               for 1 - 1/F of every 20 ms until the job ends; alive, only slow. It slows the
               worker's own computation, not its sleeps or its GPU's kernels
  term-agent   SIGTERM the torchrun agent (a preemption by SLURM or Kubernetes)
  kill-node    SIGKILL the agent and every process under it (a node lost)
  kill-agent   SIGKILL only the agent, orphaning its workers (the agent OOM-killed)
  unhealthy-node
               the node fails its self-check at its start (each of its ranks computes a wrong
               product): it is left out if the job can go on without it, else every rank exits
               2. Given at launch, not timed; wrap one node's torchrun to rehearse a multi-node
               job losing that node
  nan          torchrun rank --fault-rank's loss is NaN at step --fault-step, each time it
               trains that step (a bad sample, a device that computes wrong): no rank applies
               the step, its samples are recorded as skipped, training goes on. Given at launch
  spike        the same rank's loss is 30x at that step, its update with it (a batch that throws
               the weights off): with --loss-spike-mads every rank rolls back and skips it
  bitflip      the same rank flips one bit of one parameter after that step, once (silent data
               corruption): the replicas' digests differ, every rank rolls back and trains again
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from elastictrain import knobs

FAULTS = (
    "kill-worker",
    "stop-worker",
    "slow-worker",
    "term-agent",
    "kill-node",
    "kill-agent",
    "unhealthy-node",
    "nan",
    "spike",
    "bitflip",
)
AT_LAUNCH = ("unhealthy-node", "nan", "spike", "bitflip")
SLOW_PERIOD_S = 0.02  # shorter than a step: each step is stretched, not some stopped whole


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    return children


def children(pid: int) -> list[int]:
    return sorted(_children_map().get(pid, []))


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``, however deep."""
    tree = _children_map()
    out, todo = [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid``: tells a process from a later one that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _training_process(worker: int) -> int:
    """The process that trains for the worker torchrun started: itself, or under
    ``--replace-in-place`` its supervisor's oldest child (the spare is always the newest)."""
    supervised = [c for c in children(worker) if _has_role(c)]
    if not supervised:
        return worker
    return min(supervised, key=lambda c: int(start_time(c) or 0))


def _has_role(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"\0{knobs.ROLE}=".encode() in b"\0" + f.read()
    except OSError:
        return False


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone already


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Throttle:
    """A process slowed ``factor`` times from outside: stopped (SIGSTOP) for ``1 - 1/factor`` of
    every ``period_s`` and continued for the rest, from a thread, until :meth:`stop` (which leaves
    it running) or its exit. Its heartbeat thread is slowed with it, never silent for long."""

    def __init__(self, pid: int, factor: float, period_s: float = SLOW_PERIOD_S) -> None:
        self.pid, self.running_s = pid, period_s / factor
        self.stopped_s = period_s - self.running_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-throttle", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGCONT)
                if self._done.wait(self.running_s):
                    break
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.stopped_s)
        except ProcessLookupError:  # it exited: nothing left to slow
            return
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class Chaos:
    """One job and the faults injected into it."""

    def __init__(
        self,
        command: list[str],
        *,
        faults: list[str],
        first_s: float,
        gap_s: tuple[float, float],
        timeout_s: float,
        seed: int,
        log: IO[bytes],
        out: IO[str] = sys.stdout,
        slow_factor: float = 2.0,
        fault_at: tuple[int, int] = (100, 0),
    ) -> None:
        self.command, self.faults, self.first_s, self.gap_s = command, faults, first_s, gap_s
        self.fault_at = fault_at  # nan, spike: (step, torchrun rank)
        self.slow_factor, self.throttles = slow_factor, []
        self.timeout_s, self.seed, self.log, self.out = timeout_s, seed, log, out
        self.rng = random.Random(seed)
        self.injected: list[tuple[float, str, int]] = []
        self._t0 = 0.0

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self._t0:7.2f}s] {text}", file=self.out, flush=True)

    def inject(self, fault: str, agent: int) -> int | None:
        """Inject ``fault``; the pid it hit, or None when there was nothing to hit yet."""
        if fault in ("kill-worker", "stop-worker", "slow-worker"):
            workers = children(agent)
            if not workers:
                return None
            target = _training_process(self.rng.choice(workers))
            if fault == "slow-worker":
                self.throttles.append(Throttle(target, self.slow_factor))
            else:
                signal_all([target], signal.SIGKILL if fault == "kill-worker" else signal.SIGSTOP)
            return target
        if fault == "kill-node":
            signal_all([*descendants(agent), agent], signal.SIGKILL)
        else:
            signal_all([agent], signal.SIGTERM if fault == "term-agent" else signal.SIGKILL)
        return agent

    def run(self) -> int | None:
        """The job's exit code, or None when it outlived ``timeout_s`` and was killed."""
        self._t0 = time.monotonic()
        at_launch = [f for f in AT_LAUNCH if f in self.faults]  # once, however often named
        timed = [f for f in self.faults if f not in AT_LAUNCH]
        step, rank = self.fault_at
        given = {
            "unhealthy-node": (
                knobs.UNHEALTHY,
                "compute",
                "every rank it starts computes a wrong product in its self-check",
            ),
            "nan": (knobs.NAN, f"{step}:{rank}", f"rank {rank}'s loss is NaN at step {step}"),
            "spike": (knobs.SPIKE, f"{step}:{rank}", f"rank {rank}'s loss is 30x at step {step}"),
            "bitflip": (knobs.BITFLIP, f"{step}:{rank}", f"rank {rank} flips a bit after {step}"),
        }
        env = {**os.environ, **{given[f][0]: given[f][1] for f in at_launch}} if at_launch else None
        job = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        self.say(f"launched pid {job.pid} (seed {self.seed}): {' '.join(self.command)}")
        for fault in at_launch:
            self.injected.append((0.0, fault, job.pid))
            self.say(f"fault {len(self.injected)}: {fault} -> pid {job.pid}: {given[fault][2]}")
        seen: dict[int, str | None] = {}  # every descendant, so a dead agent's orphans are found
        stopped: list[int] = []
        due = self._t0 + self.first_s
        try:
            while job.poll() is None and time.monotonic() - self._t0 < self.timeout_s:
                for pid in descendants(job.pid):
                    seen.setdefault(pid, start_time(pid))
                done = len(self.injected) - len(at_launch)
                if done < len(timed) and time.monotonic() >= due:
                    fault = timed[done]
                    target = self.inject(fault, job.pid)
                    if target is not None:
                        if fault == "stop-worker":
                            stopped.append(target)
                        self.injected.append((time.monotonic() - self._t0, fault, target))
                        self.say(f"fault {len(self.injected)}: {fault} -> pid {target}")
                        due = time.monotonic() + self.rng.uniform(*self.gap_s)
                time.sleep(0.1)
        finally:
            code = job.poll()
            alive = {p for p, st in seen.items() if st is not None and start_time(p) == st}
            # A zombie has exited and waits to be reaped (children of a process the agent just
            # SIGKILLed, for a moment): it did not outlive anything.
            leftovers = sorted(p for p in set(descendants(job.pid)) | alive if not _zombie(p))
            if code is None:
                self.say(f"timeout after {self.timeout_s:.0f}s: killing the job")
            for throttle in self.throttles:
                throttle.stop()
            signal_all(stopped, signal.SIGCONT)
            signal_all(leftovers + ([job.pid] if code is None else []), signal.SIGKILL)
            if code is None:
                job.wait()
            elif leftovers:
                self.say(
                    f"{len(leftovers)} process(es) outlived the agent and were killed: {leftovers}"
                )
        self.say(f"job exited with {code}; {len(self.injected)} fault(s) injected")
        return code


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:split])  # --help ends here
    command = argv[split + 1 :]
    if not command:
        print(
            "error: name the job after --, e.g. python -m elastictrain chaos --fault kill-worker "
            "-- torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m elastictrain",
            file=sys.stderr,
        )
        return 2
    try:
        lo, hi = (float(x) for x in args.gap.split(":"))
    except ValueError:
        print(f"error: --gap {args.gap!r}: use A:B seconds, e.g. 4:8", file=sys.stderr)
        return 2
    if args.slow_factor <= 1:
        print(
            f"error: --slow-factor {args.slow_factor:g}: use more than 1, e.g. 2", file=sys.stderr
        )
        return 2
    kinds = args.fault or ["kill-worker"]
    faults = [kinds[i % len(kinds)] for i in range(args.faults)]
    seed = args.seed if args.seed is not None else int(time.time())
    with open(args.log, "ab") as log:
        code = Chaos(
            command,
            faults=faults,
            first_s=args.first,
            gap_s=(lo, hi),
            timeout_s=args.timeout,
            seed=seed,
            log=log,
            slow_factor=args.slow_factor,
            fault_at=(args.fault_step, args.fault_rank),
        ).run()
    print(f"job output: {args.log}")
    return 0 if code == 0 else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m elastictrain chaos",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--fault",
        action="append",
        choices=FAULTS,
        help="repeatable; cycled in order (default: kill-worker)",
    )
    p.add_argument("--faults", type=int, default=1, metavar="N", help="how many faults (default 1)")
    p.add_argument(
        "--first",
        type=float,
        default=8.0,
        metavar="S",
        help="seconds before the first fault (default 8)",
    )
    p.add_argument(
        "--gap",
        default="4:8",
        metavar="A:B",
        help="seconds between faults, drawn from A..B (default 4:8)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="kill everything after S seconds (default 600)",
    )
    p.add_argument(
        "--slow-factor",
        type=float,
        default=2.0,
        metavar="F",
        help="how many times slower slow-worker makes its worker (default 2; more than 1)",
    )
    p.add_argument(
        "--fault-step",
        type=int,
        default=100,
        metavar="S",
        help="nan, spike, bitflip: the global step (0-based) it hits (default 100)",
    )
    p.add_argument(
        "--fault-rank",
        type=int,
        default=0,
        metavar="R",
        help="nan, spike, bitflip: the torchrun rank it hits (default 0)",
    )
    p.add_argument("--seed", type=int, help="random seed, to replay a run")
    p.add_argument(
        "--log", default=f"chaos-{os.getpid()}.log", help="the job's output (default chaos-PID.log)"
    )
    return p
