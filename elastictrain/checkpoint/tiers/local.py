"""The local tier: every node keeps its own copy of the replicated state on fast node-local storage
(a per-job folder under /dev/shm by default), taken every few steps, so a crashed worker resumes
from seconds ago without reading remote storage.

With DDP every node holds a full replica, so each node's local rank 0 writes one, with the
machinery of the durable tier: a snapshot into a reused buffer, a background write, the manifest
last, checksums, retention of the newest 2. No collective is involved: nodes checkpoint locally
on their own schedules. The durable tier (``--checkpoint-dir``) keeps its own schedule and every
guarantee; the final and preemption checkpoints go there, and a finished run removes its local
tier. Resume (``tiers``) picks the newest copy on any tier that verifies.

Sharded (FSDP) state has its own tier on the same folder (``shard_tier``): every rank keeps its own
shards, and a copy of its buddy's on another node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

import storage
from elastictrain import knobs
from elastictrain.checkpoint.api import Layout, Reason
from elastictrain.checkpoint.policies import TurnTierOff
from elastictrain.checkpoint.record import SaveRecord
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.write.layouts import FlatLayout
from elastictrain.checkpoint.write.persist import Persister
from elastictrain.config import CheckpointConfig
from elastictrain.errors import NumericalFaultError
from elastictrain.observe.events import Event, EventLog
from storage.manifest import MANIFEST_NAME
from storage.urls import is_local, redact_url

logger = logging.getLogger(__name__)

KEEP = 2
LOCK_NAME = ".writer.lock"
SLACK_BYTES = 64 << 10  # per copy, beyond its tensors: the skeleton, the manifest, directories
COPIES_OF_ROOM = KEEP + 1  # the kept copies plus the one being written


def default_dir(durable_url: str, root: str) -> str:
    """One folder per durable location, so a restarted or relaunched job finds its copies and two
    jobs never share one. The location as this host resolves it (an absolute path, or the URL
    without credentials)."""
    location = os.path.abspath(os.path.expanduser(durable_url)) if is_local(durable_url) else None
    key = hashlib.sha256((location or redact_url(durable_url)).encode()).hexdigest()[:16]
    return os.path.join(root, f"elastictrain-{os.getuid()}", key)


def tier_dir(config: CheckpointConfig) -> str:
    """This node's tier folder for the run's durable location."""
    return config.local_checkpoint_dir or default_dir(
        config.checkpoint_dir, knobs.local_tier_root()
    )


def payload_bytes(tree: Any) -> int:
    """Tensor bytes of a captured state: what the local copy will take, before it is taken."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(payload_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(payload_bytes(v) for v in tree)
    return 0


class LocalSchedule:
    """When this node takes its next local copy: every N steps, or ``auto``: the interval that
    keeps what copies cost under ``overhead`` of step time. A copy costs what it blocks the loop
    (the snapshot) plus what it slows the steps that run while it is written, measured against the
    step time without one: the background write is free on a GPU node whose CPU idles, and not
    on a CPU-bound one."""

    def __init__(
        self, every: int | str, overhead: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every, self.overhead, self.clock = every, overhead, clock
        self.step_s: float | None = None
        """Step time while no copy is being written (EMA); steps that took a copy left out."""
        self.cost_s = 0.0
        self.excess_s = 0.0
        """Step time beyond ``step_s`` while the latest copy was written."""
        self.last: int | None = None
        self._t_last: float | None = None
        self._skip_next = True
        self._blocked_in_gap = 0.0

    def observe(self, *, skip: bool, writing: bool) -> None:
        """Called once per step. ``skip``: the step took a durable checkpoint (not a normal step,
        and not this tier's cost). ``writing``: a local copy's write overlapped it."""
        now = self.clock()
        if self._t_last is not None and not self._skip_next:
            # The gap after a local copy holds its snapshot, already counted as blocked.
            dt = now - self._t_last - self._blocked_in_gap
            if writing and self.step_s is not None:
                self.excess_s += max(0.0, dt - self.step_s)
            elif not writing:
                self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt
        self._t_last, self._skip_next, self._blocked_in_gap = now, skip, 0.0

    def took_copy(self, step: int, blocked_s: float) -> None:
        """A copy was just taken: its cost is known once the previous one's slowdown is in."""
        self.cost_s = blocked_s + self.excess_s
        self.excess_s, self.last, self._blocked_in_gap = 0.0, step, blocked_s

    def interval(self) -> int:
        if self.every != "auto":
            return int(self.every)
        if not self.step_s:
            return 1
        return max(1, math.ceil(self.cost_s / (self.overhead * self.step_s)))

    def due(self, step: int) -> bool:
        if self.every != "auto":
            return step % int(self.every) == 0
        if self.step_s is None:
            return False  # no step time measured yet
        return self.last is None or step - self.last >= self.interval()


class NodeCopies:
    """What a copy is for replicated state: the node's one replica, written by its local rank 0
    into the tier folder as one flat file. (``tiers.shards.RankCopies``: every rank's shards.)"""

    def folder(self, tier_dir: str, rank: int) -> str:
        return tier_dir

    def writes(self, local_rank: int) -> bool:
        return local_rank == 0

    def layout(self, world_size: int) -> Layout:
        return FlatLayout()

    def capture(self, state: tstate.TrainState, step: int) -> dict[str, Any]:
        return tstate.capture(state, step=step)

    def copy_bytes(self, captured: dict[str, Any]) -> int:
        """What one copy takes on this node's folder."""
        return payload_bytes(captured)


class LocalTier:
    """One per rank; only a node's local rank 0 writes (``self.writes``). What a copy is comes
    from ``copies``, given at construction (``NodeCopies`` by default)."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        generation: Callable[[], int],
        events: EventLog,
        attached: Callable[[], bool],
        copies: NodeCopies | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``config``: the ``local_*`` settings, and the durable location the folder is for."""
        self.config = config
        self.copies = copies or NodeCopies()
        self.dir = tier_dir(config)
        self.events = events
        self.schedule = LocalSchedule(config.local_every_steps, config.local_overhead, clock)
        self.rank, self.local_rank = rank, local_rank
        self.folder = self.copies.folder(self.dir, rank)
        self.writes = config.local_checkpoint and self.copies.writes(local_rank)
        self.store: storage.CheckpointStore | None = None
        self.writer: Persister | None = None
        self.record = SaveRecord()
        self._sized = False
        self._writing_since = False
        self._lock: int | None = None
        if not self.writes:
            return
        why = self._unusable()
        if os.path.isdir(self.folder):  # a node whose tier is off may still hold copies to offer
            self.store = storage.open_store(
                self.folder, checksum=config.checksum, retry=storage.RetryPolicy(deadline_s=5.0)
            )
        if why:
            self._off(why)
            return
        self.writer = Persister(
            store=self.store,
            layout=self.copies.layout(world_size),
            # The newest KEEP copies; milestones are the durable tier's business.
            config=dataclasses.replace(config, keep_last=KEEP, keep_every_steps=None),
            record=self.record,
            policy=TurnTierOff(),  # the local tier never stops a run
            world_size=world_size,
            generation=generation,
            events=events,
            attached=attached,
        )

    def _unusable(self) -> str | None:
        parent = os.path.dirname(self.dir.rstrip("/")) or "/"
        if self.config.local_checkpoint_dir is None and not os.path.isdir(os.path.dirname(parent)):
            return f"{os.path.dirname(parent)} does not exist on this host"
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            if self.config.local_checkpoint_dir is None:
                os.chmod(parent, 0o700)  # files readable only by the user
            os.chmod(self.dir, 0o700)
            # One writer per folder: two "nodes" on one host (or a stopped writer of an earlier
            # attempt that is still alive) must not write the same files. The lock dies with us.
            lock = os.path.join(self.folder, LOCK_NAME)
            self._lock = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            return f"another process (another node of this job on this host?) writes {self.folder}"
        except OSError as e:
            return f"cannot use {self.dir}: {e.strerror or e}"
        return None

    def _off(self, why: str) -> None:
        failure = self.record.failure
        # A copy refused for NaNs is the state's fault, not the folder's: no folder fixes it.
        state_is_bad = failure is not None and isinstance(failure.error, NumericalFaultError)
        fix = (
            ""
            if state_is_bad
            else "; set --local-checkpoint-dir to a node-local folder with room, or "
            "--no-local-checkpoint to silence this"
        )
        # INFO on rank 0 (shown there by default); other nodes' writers show only warnings.
        logger.log(
            logging.INFO if self.rank == 0 else logging.WARNING,
            "local checkpoint tier off: %s. The durable tier (--checkpoint-dir) is unaffected%s.",
            why,
            fix,
        )
        self.events.emit(Event.LOCAL_TIER, enabled=False, dir=self.dir, why=why)
        self.writes, self.writer = False, None

    @property
    def active(self) -> bool:
        return self.writer is not None

    @property
    def newest(self) -> int | None:
        """The step of this node's newest committed local copy (None on other ranks)."""
        return self.record.last_committed if self.writer is not None else None

    # -- save ----------------------------------------------------------------------------------
    def after_step(self, step: int, state: tstate.TrainState, *, durable_saved: bool) -> None:
        """On every rank after every step; local rank 0 takes a copy when one is due."""
        if not self.active:
            return
        # ``schedule.last`` is set when a copy begins, on this thread: a step repeated (``step(N)``
        # twice) is never copied twice, whether or not the first copy has committed yet.
        due = self.schedule.due(step) and self.schedule.last != step
        # A step overlapped a copy's write if one was in flight when it began or when it ended:
        # a write shorter than a step is over by the end of the step it slows.
        writing = self._writing_since or self.writer.writing
        self.schedule.observe(skip=durable_saved, writing=writing)
        if due:
            self.save(step, state)
        self._writing_since = self.active and self.writer.writing

    def save(self, step: int, state: tstate.TrainState) -> None:
        why = self._why_not(step, state)
        if why:
            self._off(why)
            return
        self._sized = True
        t0 = self.schedule.clock()
        self.writer.save(
            step,
            state.epoch_of(step),
            Reason.STEPS,
            lambda: self.copies.capture(state, step),
            background=True,
        )
        # The previous copy's slowdown of the steps since, plus this one's blocking.
        self.schedule.took_copy(step, self.schedule.clock() - t0)

    def _why_not(self, step: int, state: tstate.TrainState) -> str | None:
        """Why the tier cannot take this copy: the previous copy's background write failed, or
        (checked at the first copy) the folder lacks room."""
        if self.record.failure is not None:
            error = self.record.failure.error
            return f"a local write failed: {type(error).__name__}: {error}"
        if self._sized:
            return None
        free, need = self._room(state, step)
        if free >= need:
            return None
        self._release_own()
        return (
            f"{self.dir} has {_size(free)} free, and the tier needs {_size(need)} "
            f"({COPIES_OF_ROOM} copies of the {_size(need // COPIES_OF_ROOM)} state: "
            f"{KEEP} kept + 1 being written)"
        )

    def room(self, state: tstate.TrainState, step: int) -> tuple[int, int] | None:
        """(free bytes, the bytes the tier needs) where this rank writes; None where it writes
        nothing (the node's self-check asks, at a start)."""
        return self._room(state, step) if self.active else None

    def _room(self, state: tstate.TrainState, step: int) -> tuple[int, int]:
        """The kept copies and one being written, against the folder's free bytes."""
        need = COPIES_OF_ROOM * (
            self.copies.copy_bytes(self.copies.capture(state, step)) + SLACK_BYTES
        )
        return shutil.disk_usage(self.dir).free + _bytes_under(self.dir), need

    def own_stores(self) -> list[storage.CheckpointStore]:
        """The folders this rank writes (a node's one replica; a rank's own shards)."""
        return [self.store] if self.store is not None else []

    def _release_own(self) -> None:
        """The tier goes off for lack of room: the folder is memory, so this rank lets go of what
        it wrote there, and only that (other ranks and other nodes may share the folder). Its
        newest copy stays: the attempt may have resumed from it, and a restart before the next
        durable commit would need it. The run's end removes the rest (``remove``)."""
        for store in self.own_stores():
            with contextlib.suppress(storage.StorageError, OSError):
                committed = store.committed_steps()
                for step in store.step_dirs():
                    if step != max(committed, default=None):
                        store.delete(step)

    # -- resume --------------------------------------------------------------------------------
    def offers(self) -> list[tuple[int, int, int | None]]:
        """(generation, step, saved world size) of each committed local copy on this node.
        ``tiers`` leaves out copies of a generation the durable location never fenced (it was
        wiped since, or they belong to another run)."""
        if self.store is None:
            return []
        try:
            manifests = self.store.ranked_manifests()
        except storage.StorageError as e:
            logger.warning("local checkpoint tier unreadable, not used for resume: %s", e)
            return []
        return [(m.generation, m.step, m.metadata.get("world_size")) for m in manifests]

    # -- end -------------------------------------------------------------------------------------
    def remove(self) -> None:
        """The run finished (or was preempted) with the durable tier holding its newest state:
        the local copies are of no further use, and /dev/shm is memory."""
        if self.writer is not None:
            self.writer.wait()
        if self.config.local_checkpoint and self.local_rank == 0:
            remove_copies(self.dir)
        self.writes, self.writer, self.store = False, None, None
        self.finish()

    def finish(self) -> None:
        """Wait for the copy in flight and let go of the folder (another attempt may write)."""
        if self.writer is not None:
            self.writer.wait()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def remove_copies(root: str) -> None:
    """Remove every copy under ``root`` as retention removes a checkpoint: each manifest first,
    then the files, so a reader never meets a copy that is committed but incomplete."""
    with contextlib.suppress(OSError):
        for folder, _, names in os.walk(root):
            if MANIFEST_NAME in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, MANIFEST_NAME))
        shutil.rmtree(root)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def _bytes_under(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, name))
    return total
