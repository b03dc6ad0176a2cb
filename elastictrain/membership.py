"""Membership epochs (``--replace-in-place``): how the ranks that did not fail keep their processes
and their state, and agree with a replacement how the next epoch begins.

An epoch is one agreed set of training processes. A survivor's loop sees a peer's death as an
error from a collective (gloo's connection to the dead process resets); it keeps what it trained
(:class:`LiveState`: the state of the newest step it completed, as one flat file in memory) and
raises :class:`PeerLost`. The runner then builds the next epoch in the same process: the restart-
safe handshake on torchrun's store (a fresh nonce and generation: fresh process groups, and a
dead rank 0's background persist is fenced off), then :func:`agree`, then a resume whose bytes
come from the survivor holding the newest step (``checkpoint.resume.live``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch.distributed as dist

from elastictrain import dist as edist
from elastictrain.errors import RecurringFailureError

logger = logging.getLogger(__name__)

# What gloo and c10d say when the process at the other end of a connection is gone.
_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Socket closed|Connection refused|"
    r"ECONNRESET|EPIPE",
    re.IGNORECASE,
)
RECURRING_KEY = "elastictrain/recurring-failure"


@dataclass
class LiveState:
    """What a survivor carries into the next epoch."""

    step: int
    """Completed steps its state holds (the step in flight is dropped: its optimizer never ran)."""
    payload: bytes
    """The state at ``step`` as a flat file (``checkpoint.state``): never unpickled."""
    last_committed: int | None
    failed_seen_at: float
    """Wall-clock time this rank saw the failure."""


class PeerLost(Exception):
    """A collective failed because a peer's process is gone; the survivor's state goes with it."""

    def __init__(self, carry: LiveState, cause: BaseException) -> None:
        super().__init__(f"a peer's training process is gone at step {carry.step}: {cause}")
        self.carry = carry


def is_peer_loss(error: BaseException) -> bool:
    """Whether ``error`` says a peer's process is gone (not a bug of this rank's own)."""
    for e in _chain(error):
        if isinstance(e, dist.DistError) or (
            isinstance(e, RuntimeError) and _PEER_GONE.search(str(e))
        ):
            return True
    return False


def _chain(error: BaseException | None):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


@dataclass(frozen=True)
class Epoch:
    """How this membership epoch began, agreed by every rank."""

    replaced: list[int]
    """Ranks whose training process is a replacement (empty: a fresh start or torchrun's restart)."""
    newest_step: int
    """The newest step any survivor completed (-1: no survivor: resume from the checkpoints)."""
    source_rank: int | None
    """The lowest rank holding ``newest_step``: it sends the state."""
    last_committed: int | None
    died_at: float | None
    """When the first replaced rank's death was seen (its supervisor's clock)."""
    detected_s: float | None
    """From that death to the last survivor seeing it."""

    @property
    def in_place(self) -> bool:
        return self.newest_step >= 0

    def start_fields(self) -> dict:
        """What the ``start`` event records of an epoch that replaced ranks."""
        if not self.replaced:
            return {}
        return {
            # No survivor: every rank was replaced (a second death during the recovery), so the
            # state comes from the checkpoints, as after torchrun's restart.
            "began": "replaced in place" if self.in_place else "replaced, from the checkpoints",
            "replaced_ranks": self.replaced,
            "failed_at": self.died_at,
            "detected_s": None if self.detected_s is None else round(self.detected_s, 4),
            **({"resumed_step": self.newest_step} if self.in_place else {}),
        }


def agree(
    carry: LiveState | None,
    died_at: float | None,
    *,
    group: dist.ProcessGroup,
    store: dist.Store | None,
    rank: int,
) -> Epoch:
    """Every rank, at the start of every epoch: one small all-gather says who survived with what
    and who is a replacement. Rank 0 also asks the job's store whether a failure recurs (the same
    rank replaced at the same step before, in this job): that ends the job with a clear error on
    every rank, since replacing it again would only repeat it."""
    mine = (
        carry.step if carry else -1,
        carry.last_committed if carry else None,
        carry.failed_seen_at if carry else None,
        died_at,
    )
    everyone = edist.all_gather_object(mine, group)
    steps = [s for s, _, _, _ in everyone]
    newest = max(steps)
    replaced = [r for r, (_, _, _, d) in enumerate(everyone) if d is not None]
    deaths = [d for _, _, _, d in everyone if d is not None]
    seen = [t for _, _, t, _ in everyone if t is not None]
    committed = [c for _, c, _, _ in everyone if c is not None]
    # The earliest sign of the death: its supervisor's poll, or a survivor's failed collective.
    died = min(deaths + seen) if deaths else None
    epoch = Epoch(
        replaced=replaced,
        newest_step=newest,
        source_rank=steps.index(newest) if newest >= 0 else None,
        last_committed=max(committed) if committed else None,
        died_at=died,
        detected_s=max(seen) - died if seen and died is not None else None,
    )
    _refuse_recurring(epoch, group=group, store=store, rank=rank)
    return epoch


def _refuse_recurring(
    epoch: Epoch, *, group: dist.ProcessGroup, store: dist.Store | None, rank: int
) -> None:
    verdict = ""
    if rank == 0 and store is not None:
        if store.check([RECURRING_KEY]):
            verdict = store.get(RECURRING_KEY).decode()
        for r in epoch.replaced if epoch.in_place else ():
            if store.add(f"elastictrain/replaced/rank-{r}/step-{epoch.newest_step}", 1) > 1:
                verdict = (
                    f"rank {r}'s training process died twice at step {epoch.newest_step} "
                    "(a failure that recurs there: a bad sample, a kernel or driver fault, a "
                    "memory limit): replacing it again would only repeat it. See that rank's log "
                    "for how it died, fix the cause, and relaunch"
                )
                store.set(RECURRING_KEY, verdict)
    verdict = edist.broadcast_bytes(verdict.encode() if rank == 0 else None, group).decode()
    if verdict:
        raise RecurringFailureError(verdict)
