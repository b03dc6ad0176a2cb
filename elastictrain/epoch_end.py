"""The end of a membership epoch (``--replace-in-place``): heard by every member at once, and every
collective of the epoch failed, so that each survivor leaves it with its state.

Why: on gloo a dead peer's connections reset, so the survivors' collectives fail by themselves.
NCCL's kernels instead wait for the dead peer until the collective timeout, and its watchdog then
tears the process down (state and all). So the first process back from an epoch (a survivor that
saw the death, or the dead rank's replacement, which its supervisor starts within a tenth of a
second) announces the end in the job's store (:func:`announce`). Every member's watch
(:class:`EpochWatch`: a thread, one blocking store ``wait``, no polling) hears of it at once and
fails the epoch's collectives from that thread (:func:`abort_collectives`): NCCL's communicators
aborted, gloo's connections shut. The training thread's collective then raises, and the rank
leaves the epoch as it does on gloo (``membership.PeerLost``).

NCCL specifics (docs/faults.md, "NCCL"): the communicators are aborted together, inside one NCCL
group (``_abort_process_group``: aborting one while another hangs can deadlock, NVIDIA/nccl#1013);
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` keeps NCCL's watchdog from ending the process on the aborted
work (:func:`prepare_nccl`); and the optimizer step waits for the device (:func:`update_gate`),
since an NCCL collective returns to Python before it has run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from elastictrain import knobs
from elastictrain.errors import ConfigError

logger = logging.getLogger(__name__)

# One store wait, long: c10d logs two warnings at each timeout. Every epoch but the process's last
# ends by an announcement, which ends its watch's wait too.
_WAIT = timedelta(hours=6)
_ASYNC_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_current: EpochWatch | None = None
_aborting = threading.Lock()  # the watch and liveness's silence may both fail the epoch at once


def ended_key(nonce: str) -> str:
    return f"{nonce}/ended"


def announce(store: dist.Store, nonce: str, silent: list[int] = ()) -> None:
    """The epoch ``nonce`` is over (this process is back from it). ``silent``: its members found
    silent (a frozen host), by torchrun rank, for whoever hears of the end before rank 0's beat
    says so. The first announcement stands."""
    store.compare_set(ended_key(nonce), "", json.dumps(sorted(silent)))


class EpochWatch:
    """One epoch's watch: when its end is announced, fail its collectives (once, and never after
    :meth:`close`, when the next epoch's groups may already exist)."""

    def __init__(
        self,
        store: dist.Store,
        nonce: str,
        keep_port: int,
        connections: EpochConnections | None = None,
    ) -> None:
        """``store``: the job's store (cloned: the wait blocks its connection); ``keep_port``: its
        port, whose connections are not shut; ``connections``: the epoch's own, all it shuts."""
        self.nonce, self.keep_port = nonce, keep_port
        self.connections = connections
        self.ended = False
        self.silent: list[int] = []
        """The members the announcer found silent (torchrun ranks)."""
        self._store = store
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name="elastictrain-epoch-end", daemon=True
        )

    def start(self) -> EpochWatch:
        global _current
        _current = self
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            store = self._store.clone()  # made here: connecting can block
            while not self._closed:
                try:
                    store.wait([ended_key(self.nonce)], _WAIT)
                    break
                except dist.DistStoreError:  # the wait's timeout: look at _closed again
                    continue
            if self._closed:
                return
            silent = json.loads(store.get(ended_key(self.nonce)))
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
        with self._lock:
            if self._closed:
                return
            self.silent, self.ended = silent, True
            nccl = dist.is_initialized() and dist.get_backend() == "nccl"
            shut = abort_collectives(self.keep_port, self.connections)
        # INFO: the rank's own leaving (runner, library) is what warns.
        logger.info(
            "this membership epoch's end was announced: its collectives failed here (%s%d "
            "connections shut)",
            "NCCL's communicators aborted, " if nccl else "",
            shut,
        )

    def close(self) -> None:
        """The epoch's groups are being torn down: from now on, an announcement changes nothing."""
        global _current
        with self._lock:
            self._closed = True
        if _current is self:
            _current = None


def ended() -> bool:
    """Whether the current epoch's end was announced (its collectives then fail in any way: an
    aborted NCCL group even raises that no group exists)."""
    return _current is not None and _current.ended


def close_current() -> None:
    if _current is not None:
        _current.close()


def heard_silent() -> list[int]:
    """The members the current epoch's announcer found silent (torchrun ranks)."""
    return list(_current.silent) if _current is not None else []


def abort_collectives(keep_port: int, connections: EpochConnections | None = None) -> int:
    """Fail every collective of this process's epoch: NCCL's communicators aborted (all of them,
    inside one NCCL group), then the epoch's own TCP connections shut (gloo's, the CPU control
    group's on GPU jobs too: ``connections``, none without them; never the job store's,
    ``keep_port``). The number of connections shut.

    After an abort no group is left to destroy (``dist.shutdown`` skips it): a communicator
    aborted once is never destroyed too (pytorch#194679). An abort that hangs inside NCCL
    (NVIDIA/nccl#1777) leaves the training thread blocked, and the hang watchdog's bound
    (--hang-timeout) ends the process for torchrun's restart."""
    with _aborting:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        return break_collectives(keep_port, connections)


def break_collectives(keep_port: int, connections: EpochConnections | None = None) -> int:
    """Shut down the epoch's TCP connections (``connections``: none without them), never those
    to the job's store (port ``keep_port``); the number shut.

    Why: a frozen peer (SIGSTOP, a wedged host) keeps its sockets open, so a gloo collective
    waiting on it blocks until --collective-timeout, and gloo cannot abort one. Shutting the
    connections from under it fails the collective at once, as a dead peer's reset does, so this
    rank leaves the epoch with its state and the survivors regroup without the silent rank. The
    epoch's groups are being given up anyway; the store is kept, since the next epoch is agreed
    through it.
    """
    shut = 0
    if connections is None:  # groups not built here (a diagnostic init): nothing is known ours
        return shut
    for sock in _tcp_sockets():
        with sock:
            try:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # a listener: no collective waits on it
                local, peer = _endpoint(sock.getsockname()), _endpoint(sock.getpeername())
                if keep_port in (peer[1], local[1]) or not connections.owns(local, peer):
                    continue
                sock.shutdown(socket.SHUT_RDWR)  # the connection itself, for every fd of it
                shut += 1
            except (OSError, IndexError, TypeError):  # not connected: nothing waits on it
                continue
    return shut


class EpochConnections:
    """Which TCP connections are the epoch's: those of its gloo groups, found by their listeners.

    Every gloo group listens on a port of its own and each pair of ranks connects once, one end
    to the other's listener (``ProcessGroupGloo``'s full mesh). So a connection is the epoch's
    when one of its ends is a listener the epoch's groups opened, on any member: each member
    records its own as its groups are built (the listeners that appeared since
    :meth:`__init__`) and all of them learn everyone's (:meth:`learn`). Nothing else is touched:
    a user's socket, an S3 upload in flight (a background persist), a metrics logger's
    connection to its local service, a listener opened once training runs, or the job's store.
    """

    def __init__(self) -> None:
        """Before the epoch's first group is built."""
        self._before = _listeners()
        self._known: set[tuple[str, int]] = set()
        self._anywhere: set[int] = set()

    def learn(self, group: dist.ProcessGroup) -> None:
        """Every member, collectively, each time the epoch has built groups (its first groups;
        then the mesh, tiers and sessions, before training): every member's listeners, so that
        a connection this rank opened to a frozen member is known as the epoch's too."""
        mine = sorted(_listeners() - self._before)
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        self._known = {(host, port) for listeners in everyone for host, port in listeners}
        # A listener on every interface is seen by the other end at one host's address: its port.
        self._anywhere = {port for host, port in self._known if host in _ANY_HOST}

    def owns(self, local: tuple[str, int], peer: tuple[str, int]) -> bool:
        return bool({local, peer} & self._known) or bool({local[1], peer[1]} & self._anywhere)


def _tcp_sockets():
    """This process's TCP stream sockets (each a dup: closing it leaves the connection alone)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        if tcp:
            yield sock  # a loader worker's pipe, a unix socket: never the groups'
        else:
            sock.close()


def _listeners() -> set[tuple[str, int]]:
    found = set()
    for sock in _tcp_sockets():
        with sock, contextlib.suppress(OSError):
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found.add(_endpoint(sock.getsockname()))
    return found


_ANY_HOST = ("0.0.0.0", "::")


def _endpoint(address) -> tuple[str, int]:
    """(host, port), an IPv4 address mapped into IPv6 written as IPv4: how the other end sees it."""
    host = address[0].removeprefix("::ffff:")
    return host, int(address[1])


def refuse_unverified_nccl(device: torch.device, what: str) -> None:
    """In place on CUDA: refused (``ConfigError``) unless ``ELASTICTRAIN_NCCL_IN_PLACE=1`` asks
    for the path that has not yet run on more than one GPU; then :func:`prepare_nccl`."""
    if not knobs.nccl_in_place():
        raise ConfigError(
            f"{what} on {device} (NCCL) is built but not yet verified on multi-GPU jobs "
            '(docs/faults.md, "NCCL"): set ELASTICTRAIN_NCCL_IN_PLACE=1 to use it, or drop '
            f"{what}: a death then restarts the group."
        )
    prepare_nccl()


def prepare_nccl() -> None:
    """Before the first NCCL group of an in-place job: NCCL's watchdog must not end the process
    when the watch aborts a communicator (its default, 3, tears down the process on a failed
    collective: the survivor's state would go with it). torch's own note on
    ``_abort_process_group`` asks for 0. A value the user set is kept, with a warning."""
    value = os.environ.setdefault(_ASYNC_ERRORS, "0")
    if value != "0":
        logger.warning(
            "%s=%s: NCCL's watchdog may end this process when a peer dies, and the job then "
            "restarts every rank instead of recovering in place; unset it (or set 0)",
            _ASYNC_ERRORS,
            value,
        )


def update_gate(device: torch.device, *, twins: bool):
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
            if ended():
                raise dist.DistError("this membership epoch ended during the step (a peer died)")

        return gate
    return dist.barrier if twins else None
