"""``--replace-in-place``: the process torchrun starts supervises the rank's training process and
keeps a spare, so a training process that dies is replaced without torchrun seeing a failure.

Why a supervisor: torchrun stops every worker of a node when one exits, and every other node's
agent restarts its workers when that node re-rendezvouses (``SubprocessContext._poll`` and
``SimpleElasticAgent._invoke_run``). No flag changes that, so the process torchrun watches must
not exit: it is this one, which imports no torch and does nothing but wait.

- It starts the training process (``python -m elastictrain`` again, role ``worker``) and a spare
  (role ``spare``), which imports torch and builds the task, then waits on its stdin.
- When the training process dies by a signal (SIGKILL, the OOM killer, a segfault), the spare is
  told to go (one line on its stdin: when the death was seen), becomes the rank's training
  process and joins the survivors' next membership epoch (``membership``), and a new spare starts
  while ``--max-replacements`` leaves one to use.
- Any exit the training process chose (0, a bad flag, a hang it detected, a preemption) is this
  process's exit: today's restart-all path, with all its guarantees. So is a death once
  ``--max-replacements`` are used up.
- Stop signals are forwarded to the training process alone. Its children live in their own
  process group so that torchrun's ``killpg`` reaches them once, through here.
- If the agent dies, this process kills both children and exits 6, as a training process would.
- A training process whose node was evicted (exit 9, ``inplace.eviction``) is not replaced: this
  process ends the spare and, on the node's first local rank, stops the node's torchrun agent
  with SIGTERM, then exits 9 once the agent's own SIGTERM arrives. Only a signal takes a node out
  of a torchrun job cleanly: an agent that exits by itself closes the job's rendezvous for good,
  and one that sees its workers fail restarts them, which restarts every node's workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

from elastictrain import knobs

GO = "go"

EXIT_ORPHANED = 6  # errors.EXIT_ORPHANED; not imported: errors is cheap but this module is leaner
EXIT_EVICTED = 9  # errors.EXIT_EVICTED
AGENT_STOP_S = 60.0  # how long an evicted rank waits for its agent's SIGTERM before exiting
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
POLL_S = 0.05  # how often the death of the training process is looked for: the detection floor
# A spare that keeps dying (a broken import, the node out of memory) is started again after
# 1, 2, 4 ... 60 s, not at every poll: each start imports torch (seconds of CPU) beside training.
SPARE_BACKOFF_S = (1.0, 60.0)
SPARE_SETTLED_S = 60.0  # a spare alive this long has started well: the next death waits 1 s again

logger = logging.getLogger(__name__)


def role() -> str | None:
    """This process's role under a supervisor, or None for the process torchrun started."""
    return knobs.role()


def wait_for_go() -> float | None:
    """A spare: block until the supervisor says go; the time the death was seen (wall clock), or
    None when the supervisor is gone (stdin closed): the spare then just exits."""
    line = sys.stdin.readline()
    if not line.startswith(GO):
        return None
    return float(line.split()[1])


class Supervisor:
    def __init__(
        self,
        argv: list[str],
        *,
        max_replacements: int,
        rank: int,
        program: tuple[str, ...] = ("-m", "elastictrain"),
        stopped_s: float | None = None,
    ) -> None:
        """``program``: what the children run (the runner; a test's stand-in). ``stopped_s``:
        how long the training process may stay stopped (--silent-timeout) before it is ended."""
        self.argv, self.rank, self.program = argv, rank, program
        self.stopped_s, self._stopped_at = stopped_s, None
        self.max_replacements = max_replacements
        self.replaced = 0
        self.agent_pid = os.getppid()
        self.stopping: signal.Signals | None = None
        self.worker = self._start("worker")
        self.spare: subprocess.Popen | None = self._start("spare") if self._spare_useful() else None
        self._spare_started = time.monotonic()
        self._spare_deaths = 0
        self._next_spare_at = 0.0

    def _start(self, role_name: str) -> subprocess.Popen:
        env = {**os.environ, knobs.ROLE: role_name, knobs.AGENT_PID: str(os.getppid())}
        return subprocess.Popen(
            [sys.executable, *self.program, *self.argv],
            env=env,
            stdin=subprocess.PIPE if role_name == "spare" else None,
            # A group of its own (Popen's process_group=0 is 3.11+): torchrun's killpg reaches
            # this process alone, and it forwards.
            preexec_fn=os.setpgrp,  # noqa: PLW1509 - nothing but setpgid runs before exec
        )

    def _forward(self, sig: int, _frame) -> None:
        self.stopping = signal.Signals(sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.worker.pid, sig)

    def run(self) -> int:
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        try:
            return self._watch()
        finally:
            self._end(self.spare)

    def _watch(self) -> int:
        while True:
            code = self.worker.poll()
            if code is None:
                self._keep_a_spare()
            if code is None:
                if os.getppid() != self.agent_pid:
                    logger.error(
                        "rank %d: the torchrun agent (pid %d) is gone; ending the training "
                        "process and its spare",
                        self.rank,
                        self.agent_pid,
                    )
                    self._end(self.worker)
                    return EXIT_ORPHANED
                self._end_if_stopped_too_long()
                time.sleep(POLL_S)
                continue
            if code == EXIT_EVICTED and self.stopping is None:
                return self._leave_the_job()
            if code >= 0 or self.stopping is not None:
                return code if code >= 0 else 128 - code
            died = signal.Signals(-code)
            if self.replaced >= self.max_replacements:
                logger.error(
                    "rank %d: the training process died (%s) and --max-replacements %d are used "
                    "up: leaving it to torchrun to restart the group",
                    self.rank,
                    died.name,
                    self.max_replacements,
                )
                return self._die_like(died)
            if self.spare is None:  # none ready (a spare that keeps dying is backing off)
                logger.error(
                    "rank %d: the training process died (%s) and no spare is ready (the last "
                    "one exited, see above): leaving it to torchrun to restart the group",
                    self.rank,
                    died.name,
                )
                return self._die_like(died)
            self.replaced += 1
            logger.warning(
                "rank %d: the training process (pid %d) died (%s); its spare (pid %d) takes "
                "its place (replacement %d of --max-replacements %d)",
                self.rank,
                self.worker.pid,
                died.name,
                self.spare.pid,
                self.replaced,
                self.max_replacements,
            )
            try:
                self.spare.stdin.write(f"{GO} {time.time():.6f}\n".encode())
                self.spare.stdin.flush()
            except (BrokenPipeError, OSError):  # the spare died too: nothing left to do here
                return self._die_like(died)
            self.worker = self.spare
            self.spare = self._start("spare") if self._spare_useful() else None
            self._spare_started = time.monotonic()

    def _leave_the_job(self) -> int:
        """The node was evicted: no replacement; the node's agent is stopped by a signal (see
        the module's doc), and this process exits when the agent stops it in turn."""
        self._end(self.spare)
        self.spare = None
        if os.environ.get("LOCAL_RANK", "0") == "0":
            logger.warning(
                "rank %d: this node was evicted; stopping its torchrun agent (pid %d)",
                self.rank,
                self.agent_pid,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.agent_pid, signal.SIGTERM)
        deadline = time.monotonic() + AGENT_STOP_S
        while self.stopping is None and os.getppid() == self.agent_pid:
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return EXIT_EVICTED

    def _spare_useful(self) -> bool:
        """Once --max-replacements are used up the next death is torchrun's: a spare then would
        import torch and build the task (seconds of CPU, a device context on a GPU) for nothing."""
        return self.replaced < self.max_replacements

    def _keep_a_spare(self) -> None:
        """A spare that exited (the OOM killer, a broken import) is started again, backing off
        while it keeps dying."""
        now = time.monotonic()
        if self.spare is not None and self.spare.poll() is not None:
            settled = now - self._spare_started >= SPARE_SETTLED_S
            self._spare_deaths = 1 if settled else self._spare_deaths + 1
            first, most = SPARE_BACKOFF_S
            delay = min(most, first * 2 ** (self._spare_deaths - 1))
            logger.warning(
                "rank %d: the spare exited (%s); starting another in %.0fs",
                self.rank,
                self.spare.returncode,
                delay,
            )
            self.spare, self._next_spare_at = None, now + delay
        if self.spare is None and now >= self._next_spare_at and self._spare_useful():
            self.spare, self._spare_started = self._start("spare"), now

    def _end_if_stopped_too_long(self) -> None:
        """A training process stopped (SIGSTOP, a debugger) past ``stopped_s``: the others have
        gone on without it after --silent-timeout, so end it; its replacement then finds the
        epoch went on, and exits 3 for torchrun to grow the group back."""
        if self.stopped_s is None or _state(self.worker.pid) != "T":
            self._stopped_at = None
            return
        now = time.monotonic()
        self._stopped_at = self._stopped_at or now
        if now - self._stopped_at > self.stopped_s:
            logger.error(
                "rank %d: the training process (pid %d) has been stopped for %.0fs; ending it",
                self.rank,
                self.worker.pid,
                now - self._stopped_at,
            )
            self.worker.kill()
            self._stopped_at = None

    def _die_like(self, died: signal.Signals) -> int:
        """End as the training process did, so torchrun's failure record names the signal."""
        self._end(self.spare)
        if died not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(died, signal.SIG_DFL)
        os.kill(os.getpid(), died)
        return 128 + died  # only for a signal that does not end a process (never here)

    @staticmethod
    def _end(proc: subprocess.Popen | None) -> None:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (``T``: stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def supervise(
    argv: list[str],
    *,
    max_replacements: int,
    rank: int,
    stopped_s: float | None = None,
    program: tuple[str, ...] = ("-m", "elastictrain"),
) -> int:
    """``program``: what the children run after the interpreter: the runner, or library mode's
    script with the interpreter's own options (``sys.orig_argv``)."""
    logging.basicConfig(level=logging.INFO, format="[elastictrain supervisor] %(message)s")
    return Supervisor(
        argv, max_replacements=max_replacements, rank=rank, program=program, stopped_s=stopped_s
    ).run()
