"""The end of a membership epoch (``--replace-in-place``): heard by every member at once, and every
collective of the epoch failed, so that each survivor leaves it with its state.

Why: on gloo a dead peer's connections reset, so the survivors' collectives fail by themselves.
NCCL's kernels instead wait for the dead peer until the collective timeout, and its watchdog then
tears the process down (state and all). So the first process back from an epoch (a survivor that
saw the death, or the dead rank's replacement, which its supervisor starts within a tenth of a
second) announces the end in the job's store (:func:`announce`). Every member's watch
(:meth:`EpochEnd.watch`: a thread, one blocking store ``wait`` on a key of its own, no polling)
hears of it at once and fails the epoch's collectives from that thread
(:func:`abort_collectives`): NCCL's communicators aborted, gloo's connections shut (only the
epoch's own: ``connections``). The training thread's collective then raises, and the rank leaves
the epoch as it does on gloo (``members.PeerLost``).

Why a key per member: a process's last watch must end before the interpreter finalizes. A
thread whose store ``wait`` returns during finalization (the key set, or the store's host exiting
first) is ended by CPython inside torch's C++ frames, and the process aborts ("terminate called
without an active exception", SIGABRT: torchrun counts a failure after a clean finish). A
``wait`` ends only when its keys are set, and TCPStore has no "any of these keys", so each member
waits on its own wake key: the announcer sets them all in one ``multi_set``, and a member closing
its last epoch sets its own (:meth:`EpochEnd.close` with ``wait``).

NCCL specifics (docs/faults.md, "NCCL"): the communicators are aborted together, inside one NCCL
group (``_abort_process_group``: aborting one while another hangs can deadlock, NVIDIA/nccl#1013);
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` keeps NCCL's watchdog from ending the process on the aborted
work (:func:`prepare_nccl`); and the optimizer step waits for the device (:func:`update_gate`),
since an NCCL collective returns to Python before it has run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from elastictrain import knobs
from elastictrain.cluster.connections import EpochConnections, break_collectives
from elastictrain.cluster.job_store import BoundedCalls
from elastictrain.errors import ConfigError

logger = logging.getLogger(__name__)

# One store wait, long: c10d logs two warnings at each timeout. Every epoch but the process's last
# ends by an announcement, which ends its watch's wait too.
_WAIT = timedelta(hours=6)
_WAKE_S = 5.0  # a closing member's own wake-up, and the wait for its watch to end
_ASYNC_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def ended_key(nonce: str) -> str:
    return f"{nonce}/ended"


def wake_key(nonce: str, member: int) -> str:
    """What ``member``'s watch of the epoch ``nonce`` waits on."""
    return f"{nonce}/ended/{member}"


def announce(
    store: dist.Store, nonce: str, members: Sequence[int], silent: Sequence[int] = ()
) -> None:
    """The epoch ``nonce`` (of ``members``, torchrun ranks) is over: this process is back from
    it. ``silent``: its members found silent (a frozen host), for whoever hears of the end before
    rank 0's beat says so. The first announcement stands, and only its announcer wakes the
    members (one request, whatever W; every survivor of a death announces)."""
    verdict = json.dumps({"silent": sorted(silent), "by": f"{socket.gethostname()}:{os.getpid()}"})
    if store.compare_set(ended_key(nonce), "", verdict).decode() != verdict:
        return
    store.multi_set([wake_key(nonce, m) for m in members], [b"1"] * len(members))


class EpochEnd:
    """One epoch's end, as this process sees it: whether its collectives were failed (by the
    announcement its watch heard, or by liveness finding a member silent), and by whom.

    :attr:`failed` is set *before* any collective is failed, under the same lock, so the training
    thread whose collective then raises always finds it set, whichever thread failed them: on
    NCCL an aborted group fails in many ways (down to "no default process group"), and only this
    flag says it was the epoch's end, not a bug of this rank's own."""

    def __init__(
        self,
        nonce: str,
        keep_port: int,
        connections: EpochConnections | None = None,
        *,
        member: int,
    ) -> None:
        """``keep_port``: the job store's port, whose connections are never shut;
        ``connections``: the epoch's own (``dist.ProcessGroups.connections``), all it shuts;
        ``member``: this process's torchrun rank (its wake key)."""
        self.nonce, self.keep_port, self.connections = nonce, keep_port, connections
        self.member = member
        self._store: dist.Store | None = None  # the job's store, for close()'s own wake-up
        self.failed = False
        self.silent: list[int] = []
        """The members the announcer found silent (torchrun ranks)."""
        self._closed = False
        self._lock = threading.Lock()  # the watch and liveness's silence may both fail it at once
        self._thread: threading.Thread | None = None

    def fail(self, why: str) -> int:
        """Fail every collective of the epoch (:func:`abort_collectives`), once, never after
        :meth:`close`; the number of connections shut."""
        with self._lock:
            if self._closed:
                return 0
            self.failed = True  # first: whoever's collective raises next must find it
            nccl = dist.is_initialized() and dist.get_backend() == "nccl"
            shut = abort_collectives(self.keep_port, self.connections)
        logger.info(
            "membership epoch %s: %s; its collectives failed here (%s%d connections shut)",
            self.nonce,
            why,
            "NCCL's communicators aborted, " if nccl else "",
            shut,
        )
        return shut

    def watch(self, store: dist.Store) -> EpochEnd:
        """Hear the announcement of this epoch's end in the job's ``store`` (cloned: the wait
        blocks its connection), from a thread: one blocking ``wait``, no polling."""
        self._store = store
        self._thread = threading.Thread(
            target=self._watch, args=(store,), name="elastictrain-epoch-end", daemon=True
        )
        self._thread.start()
        return self

    def _watch(self, job_store: dist.Store) -> None:
        try:
            store = job_store.clone()  # made here: connecting can block
            while not self._closed:
                try:
                    store.wait([wake_key(self.nonce, self.member)], _WAIT)
                    break
                except dist.DistStoreError:  # the wait's timeout: look at _closed again
                    continue
            if self._closed:
                return
            silent = json.loads(store.get(ended_key(self.nonce)))["silent"]
        except Exception as e:  # the store is gone: liveness names it and ends the rank
            if not self._closed:  # after close() the store may go with the epoch: nothing to say
                logger.warning(
                    "the watch of membership epoch %s stopped (%s: %s): its end is no longer "
                    "heard here, only through liveness",
                    self.nonce,
                    type(e).__name__,
                    e,
                )
            return
        self.silent = silent
        # INFO: the rank's own leaving (the driver) is what warns.
        self.fail("its end was announced")

    def close(self, wait: bool = False) -> None:
        """The epoch's groups are being torn down: from now on, nothing fails them.

        ``wait``: the process is done with its epochs (it finishes or exits): its watch is woken
        by its own key and joined, so that no thread of ours is inside a store ``wait`` when the
        interpreter finalizes (the module's docstring). Without it the watch ends when the epoch's
        end is announced, as it is whenever a peer was lost."""
        with self._lock:
            self._closed = True
        thread = self._thread
        if not wait or thread is None or thread is threading.current_thread():
            return
        if not thread.is_alive():
            return
        wake = wake_key(self.nonce, self.member)
        try:
            BoundedCalls(_WAKE_S, "elastictrain-epoch-end-wake")(
                lambda: self._store.set(wake, b"closed")
            )
            thread.join(_WAKE_S)
        except Exception as e:  # the store is gone or frozen: nothing can wake the wait
            logger.warning("the job's store did not take the wake-up (%s: %s)", type(e).__name__, e)
        if thread.is_alive():
            logger.warning(
                "the watch of membership epoch %s did not end: if the job's store answers it "
                "while this process exits, the process may abort (SIGABRT)",
                self.nonce,
            )


def abort_collectives(keep_port: int, connections: EpochConnections | None = None) -> int:
    """Fail every collective of this process's epoch: NCCL's communicators aborted (all of them,
    inside one NCCL group), then the epoch's own TCP connections shut (gloo's, the CPU control
    group's on GPU jobs too: ``connections``, none without them; never the job store's,
    ``keep_port``). The number of connections shut.

    After an abort no group is left to destroy (``dist.shutdown`` skips it): a communicator
    aborted once is never destroyed too (pytorch#194679). An abort that hangs inside NCCL
    (NVIDIA/nccl#1777) leaves the training thread blocked, and the hang watchdog's bound
    (--hang-timeout) ends the process for torchrun's restart."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    return break_collectives(keep_port, connections)


def refuse_unverified_nccl(device: torch.device, what: str) -> None:
    """In place on CUDA: refused (``ConfigError``) unless ``ELASTICTRAIN_NCCL_IN_PLACE=1`` asks
    for the path that has not yet run on more than one GPU. A check only: the driver prepares
    NCCL (:func:`prepare_nccl`) as it builds a CUDA epoch's groups."""
    if not knobs.nccl_in_place():
        raise ConfigError(
            f"{what} on {device} (NCCL) is built but not yet verified on multi-GPU jobs "
            '(docs/faults.md, "NCCL"): set ELASTICTRAIN_NCCL_IN_PLACE=1 to use it, or drop '
            f"{what}: a death then restarts the group."
        )


def prepare_nccl() -> None:
    """Before an in-place epoch's NCCL groups: NCCL's watchdog must not end the process when the
    watch aborts a communicator (its default, 3, tears down the process on a failed collective:
    the survivor's state would go with it). torch's own note on ``_abort_process_group`` asks
    for 0. Every NCCL group reads it as it is built (the mesh's too), so it stays set for the
    process. A value the user set is kept, with a warning."""
    value = os.environ.setdefault(_ASYNC_ERRORS, "0")
    if value != "0":
        logger.warning(
            "%s=%s: NCCL's watchdog may end this process when a peer dies, and the job then "
            "restarts every rank instead of recovering in place; unset it (or set 0)",
            _ASYNC_ERRORS,
            value,
        )


def update_gate(device: torch.device, *, twins: bool, end: EpochEnd | None):
    """What runs between the gradients' sync and the optimizer step, in place (None: nothing).

    - CUDA (NCCL): the device synchronised, a barrier of every rank, the device synchronised
      again, then a check that the epoch is not over. An NCCL collective returns before it has
      run, and one the watch aborted leaves partial sums behind: without the gate a survivor
      could step on them. With it a rank steps only once every rank's gradients are in.
    - CPU, replicated shards (``twins``, HSDP): a barrier. Each replica group's all-reduce is a
      collective of its own; without the barrier a death mid-step can leave the shard positions
      at different steps, and no step is then whole in the survivors' memory.

    A death inside the gate itself (some ranks through, some not) leaves each rank's state
    whole at one of two steps; the recovery takes the newest whole one (or rolls back)."""
    if device.type == "cuda":

        def gate() -> None:
            torch.cuda.synchronize(device)
            dist.barrier(device_ids=[device.index])
            torch.cuda.synchronize(device)
            if end is not None and end.failed:
                raise dist.DistError("this membership epoch ended during the step (a peer died)")

        return gate
    return dist.barrier if twins else None
