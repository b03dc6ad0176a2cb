"""Liveness, apart from progress: a frozen peer is found in seconds, not at --collective-timeout.

A host that freezes (SIGSTOP, a wedged NIC or GPU, a hung kernel) keeps its sockets open, so its
peers wait in their collectives until the collective timeout (600 s in the recipes;
docs/measurements.md). Step progress cannot tell a frozen peer from a
slow step, so every rank also shows it is alive from a thread of its own, which needs no progress:

- every ``--heartbeat-seconds`` each rank sets its beat key in the attempt's c10d store (a counter,
  its step, its host and its watchdog phase), and reads rank 0's beat: 2 requests per beat,
  whatever W;
- rank 0 reads every rank's beat with one ``multi_get``; a rank whose beat has not changed for
  ``--silent-timeout`` is silent. Rank 0 writes the verdict into its own beat, which every rank
  reads at its next beat, and every rank exits 8 naming the silent ranks and hosts, so torchrun
  re-forms the group without them (its keep-alive drops the frozen agent);
- every rank watches rank 0's beat the same way, so a frozen rank 0 is found too;
- a store that stops answering for ``--silent-timeout`` ends the rank the same way, naming the
  store, from the attempt's first request on (``watch_store``: the handshake and process-group
  init wait on the store too). The workers share torchrun's rendezvous store (``job_store``);
  when that lives on the frozen host, torchrun cannot re-form the group at all: the recipe then
  needs a rendezvous endpoint off the training nodes (docs/faults.md);
- the phases in the beats tell the hang watchdog when a peer is inside a gate (``excuse``), so a
  rank waiting for it in a collective is not called hung by its learned step budget;
- a rank that stops its beats on the way out says so (``done``): it is not silent.

A watcher that was itself stopped (its own beats late) judges nobody for that round: after a
pause its view of everyone is stale, not theirs of it. The default silence, 15 s, is above the
10 s stall (swap storm, long GC, SIGSTOP then SIGCONT) a live rank must survive; beats every 2 s
keep the store's load at W requests a second (docs/scale.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from elastictrain.cluster.job_store import BoundedCalls, JobStore
from elastictrain.errors import EXIT_PEER_SILENT
from elastictrain.observe.events import Cause

if TYPE_CHECKING:  # the store's type only: this module runs before torch is needed
    import torch.distributed as dist

logger = logging.getLogger(__name__)

_PREFIX = "elastictrain/alive/"


def _beat_key(rank: int) -> str:
    return f"{_PREFIX}beat/{rank}"


class Liveness:
    """One rank's heartbeat thread and its watch: rank 0 over every rank, every rank over rank 0."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        interval_s: float,
        silent_s: float,
        step: Callable[[], int | None] = lambda: None,
        phase: Callable[[], str] = lambda: "training",
        on_silent: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str | None = None,
        last_words: Callable[[str, str], None] = lambda cause, detail: None,
    ) -> None:
        """``step``, ``phase``: this rank's last completed step and its watchdog phase, carried in
        its beat (peers in a gate excuse the others' slow steps: ``excuse``). ``on_silent``:
        called with the reason; default logs it, records the ``last_words`` (cause, detail) for
        the run report and exits 8."""
        self.rank, self.world_size = rank, world_size
        self.interval_s, self.silent_s = interval_s, silent_s
        self._store: dist.Store | None = None
        self._step, self._phase = step, phase
        self._on_silent = on_silent or self.exit_silent
        self.store_lost = False
        self.peer_silent = False
        """Set when this rank left its epoch because a peer went silent (``membership.drop_silent``)."""
        """Set when the silence is the store's own (nothing can be agreed without it)."""
        self._clock = clock
        self._host = host or socket.gethostname()
        self._seq = 0
        self._watched = list(range(world_size)) if rank == 0 else [0]
        self._seen: dict[int, str] = {}
        self._changed: dict[int, float] = {}
        self._last_round: float | None = None
        self._last_ok = clock()
        self._unanswered = False  # a failed store request said (once a streak)
        # A frozen store ignores its client's timeout: each request waits one beat at most.
        self._ask = BoundedCalls(interval_s, name="elastictrain-liveness-store")
        self._store_name = "the job's store"
        self._start_lost: Callable[[dist.Store], str | None] | None = None
        self._watched_store: dist.Store | None = None  # before start(): the store, and the
        self._probe_connection: dist.Store | None = None  # probe's own connection to it
        self._started = threading.Event()
        self._gated: list[int] = []  # rank 0: the ranks its last look found inside a gate
        self.verdict: list[dict[str, Any]] | None = None
        """The silent ranks this rank found, or heard of from rank 0. Rank 0 keeps its verdict in
        every later beat, its last (``done``) one too: the others watch only rank 0, and under
        --replace-in-place rank 0 leaves the epoch at once, so a ``done`` beat without it would
        leave them waiting on the silent peer."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastictrain-liveness", daemon=True)
        self.last_words = last_words

    def watch_store(
        self, job_store: JobStore, start_lost: Callable[[dist.Store], str | None] | None = None
    ) -> None:
        """From the attempt's first store request until :meth:`start`: the beat thread asks the
        store one ``check`` a beat, so a store that stops answering while the handshake or the
        process-group init waits on it (their requests ignore their timeouts then) ends the rank
        in ``--silent-timeout``, naming the store, as a silent peer does later. ``start_lost``:
        asked each beat too, on the probe's connection (``agents.StartWatch.lost``): why this
        start cannot complete (a node lost while the job starts), which ends the rank at once
        (exit 8) so torchrun re-forms the group."""
        if not self.enabled:
            return
        self._start_lost = start_lost
        self._store_name, self._watched_store = job_store.name, job_store.store
        self._last_ok = self._clock()
        self._thread.start()

    def _probe(self) -> str | None:
        if self._probe_connection is None:  # made on the asking thread: connecting can block
            self._probe_connection = self._watched_store.clone()
        self._probe_connection.check([f"{_PREFIX}probe"])
        if self._start_lost is None:
            return None
        return self._start_lost(self._probe_connection)

    def announce(self, store: dist.Store) -> None:
        """This rank's first beat (with its host) in the attempt's store (its keys die with the
        rendezvous), before the group's first barrier: a watcher's read of every beat never waits
        for a key that is not there yet."""
        if not self.enabled:
            return
        self._store = store
        self._store.set(_beat_key(self.rank), self._beat_value())

    @property
    def enabled(self) -> bool:
        """Off with one rank (nobody to watch) or a silence of 0 (``--silent-timeout 0``)."""
        return self.world_size > 1 and self.silent_s > 0

    def start(self) -> Liveness:
        """Beat from the attempt's store (after :meth:`announce`)."""
        if not self.enabled or self._store is None:
            return self
        # Its own connection, with the silence as its timeout: a frozen store answers nothing.
        beats = self._store.clone()
        beats.set_timeout(timedelta(seconds=self.silent_s))
        self._store = beats
        self._started.set()  # the thread turns from watching the store to beating
        if not self._thread.is_alive():  # not watched before (the unit tests)
            self._last_ok = self._clock()
            self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """End the beats, saying so in a last one: a rank that finished (or left by an error that
        its peers see in their collectives) is not silent while its peers still close up, e.g.
        rank 0 committing the final checkpoint. ``wait=False``: not for the beat thread, which
        may be inside a store request for seconds (an in-place epoch ends; the thread is a
        daemon, and ends at its next wake)."""
        self._stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval_s + 1.0)
        if self._store is not None:  # announced: peers may be watching this rank
            with contextlib.suppress(Exception):  # best effort: the store may be gone already
                self._ask(
                    lambda: self._store.set(_beat_key(self.rank), self._beat_value(done=True))
                )

    def _beat_value(self, verdict: list[dict[str, Any]] | None = None, done: bool = False) -> str:
        doc: dict[str, Any] = {
            "seq": self._seq,
            "step": self._step(),
            "host": self._host,
            "phase": self._phase(),
        }
        if self.rank == 0 and self._gated:  # for the ranks that only watch rank 0
            doc["gated"] = self._gated
        verdict = verdict or (self.verdict if self.rank == 0 else None)
        if verdict:
            doc["silent"] = verdict
        if done:
            doc["done"] = True
        return json.dumps(doc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            reason = self.round()
            if reason is not None:
                # A round may take seconds; an epoch ended meanwhile (stop) is not this one's to end.
                if not self._stop.is_set():
                    self._on_silent(reason)
                return

    def _exchange(self) -> list[str]:
        """Set this rank's beat, read the watched ones'."""
        self._store.set(_beat_key(self.rank), self._beat_value())
        values = self._store.multi_get([_beat_key(r) for r in self._watched])
        return [bytes(v).decode() for v in values]

    def round(self) -> str | None:
        """One beat and one look; the reason to exit, or None. Public for the tests' clocks."""
        now = self._clock()
        # Late ourselves (paused, starved): our view of the others is stale, so judge nobody now.
        away = self._last_round is not None and now - self._last_round > 2 * self.interval_s
        self._last_round = now
        self._seq += 1
        # Watching the store only, between watch_store() and start(): no beats to judge yet.
        probing = self._watched_store is not None and not self._started.is_set()
        try:
            values = self._ask(self._probe if probing else self._exchange)
        except Exception as e:
            quiet = self._clock() - self._last_ok
            if not self._unanswered:  # once a streak: a store may be slow for a beat or two
                logger.warning(
                    "%s did not answer a heartbeat (%s: %s); this rank exits if it stays silent "
                    "for --silent-timeout (%gs)",
                    self._store_name,
                    type(e).__name__,
                    str(e).splitlines()[0][:120] if str(e) else "",
                    self.silent_s,
                )
            self._unanswered = True
            if quiet >= self.silent_s:
                self.store_lost = True
                return (
                    f"{self._store_name} stopped answering for {quiet:.0f}s ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:120]}); its host is frozen or unreachable"
                )
            return None
        self._last_ok = now = self._clock()
        self._unanswered = False
        if probing:
            if values is not None and not self._started.is_set():
                self.exit_silent(values)  # nothing to leave yet: torchrun re-forms the group
            return None
        for rank, value in zip(self._watched, values, strict=True):
            if away or self._seen.get(rank) != value:
                self._seen[rank], self._changed[rank] = value, now
        if self.rank == 0:
            self._gated = [r for r in self._watched if _in_gate(self._seen[r])][:8]
        verdict = json.loads(self._seen[0]).get("silent") if self.rank != 0 else None
        if verdict:
            self.verdict = verdict
            return "rank 0 saw " + _describe(verdict)
        silent = [
            r
            for r in self._watched
            if r != self.rank
            and now - self._changed[r] >= self.silent_s
            and not json.loads(self._seen[r]).get("done")
        ]
        if not silent:
            return None
        verdict = [
            {
                "rank": r,
                "host": json.loads(self._seen[r])["host"],
                "silent_s": round(now - self._changed[r], 1),
            }
            for r in silent
        ]
        self.verdict = verdict
        if self.rank == 0:  # tell everyone at their next beat
            with contextlib.suppress(Exception):  # this rank exits either way
                self._ask(lambda: self._store.set(_beat_key(0), self._beat_value(verdict)))
        return _describe(verdict)

    def excuse(self) -> str | None:
        """Why a peer may keep this rank waiting past its learned step budget: a peer inside a
        phase of its own budget (a checkpoint gate, evaluation, a wait for its loader), as the
        last beats say; rank 0 sees every rank's, the others see rank 0's and its summary."""
        if not self.enabled or 0 not in self._seen:
            return None
        if self.rank == 0:
            gated = [r for r in self._gated if r != 0]
        else:
            doc = json.loads(self._seen[0])
            gated = doc.get("gated") or ([0] if _in_gate(self._seen[0]) else [])
        return f"rank(s) {gated} inside a gate" if gated else None

    def exit_silent(self, reason: str) -> None:
        """The default on a silence: say so, leave last words, exit 8."""
        line = (
            f"PEER SILENT: {reason} (--silent-timeout={self.silent_s:g}s, beats every "
            f"{self.interval_s:g}s); exiting {EXIT_PEER_SILENT} so torchrun re-forms the group "
            "without it"
        )
        logger.error(line)
        with contextlib.suppress(Exception):  # last words must never stop the exit
            self.last_words(Cause.PEER_SILENT, reason)
        logging.shutdown()
        os._exit(EXIT_PEER_SILENT)


def _in_gate(beat: str) -> bool:
    doc = json.loads(beat)
    return doc.get("phase", "training") not in ("training", "startup") and not doc.get("done")


def _describe(verdict: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"no heartbeat from rank {v['rank']} on host {v['host']} for {v['silent_s']}s"
        for v in verdict
    )
