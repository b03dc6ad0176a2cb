"""How a membership epoch began, agreed by every member (``--replace-in-place``): who is a
replacement, the newest step a survivor holds and who sends it, and whether the failure that ended
the epoch before recurs, which ends the job instead of repeating it (``members`` says who the
members are; this module, what they agree once they are in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elastictrain.checkpoint.resume.live import Live
from elastictrain.cluster import collectives as leaf_collectives
from elastictrain.errors import RecurringFailureError
from elastictrain.inplace.members import LiveState

RECURRING_KEY = "elastictrain/recurring-failure"


@dataclass(frozen=True)
class EpochStart:
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
    previous_world_size: int | None = None
    """The failed epoch's world size (None after a fresh start or torchrun's restart)."""
    receivers: tuple[int, ...] = ()
    """The ranks that do not hold ``newest_step`` (replacements, a survivor one step behind):
    only they receive it."""

    @property
    def in_place(self) -> bool:
        """Some rank survived with its state: it comes from memory, not the checkpoints."""
        return self.newest_step >= 0

    def live(self, carry: LiveState | None) -> Live | None:
        """Where the state comes from: a survivor's memory (None: the checkpoints)."""
        if not self.in_place:
            return None
        return Live(
            carry.captured if carry is not None else None,
            carry.step if carry is not None else -1,
            carry.layout if carry is not None else None,
            self.source_rank,
            self.last_committed,
            self.previous_world_size,
            self.receivers,
        )

    def start_fields(self) -> dict:
        """What the ``start`` event records of an epoch that replaced ranks."""
        if not self.replaced and not self.in_place:
            return {}
        if not self.in_place:
            # No survivor: every rank was replaced (a second death during the recovery), so the
            # state comes from the checkpoints, as after torchrun's restart.
            began = "replaced, from the checkpoints"
        elif self.replaced:
            began = "replaced in place"
        else:
            began = "shrunk in place"
        return {
            "began": began,
            "replaced_ranks": self.replaced,
            "failed_at": self.died_at,
            "detected_s": None if self.detected_s is None else round(self.detected_s, 4),
            # The newest step a survivor held: the resume's step when every shard is held (a
            # rollback to the copies, sharded without replicas, resumes older: its event says).
            **({"held_step": self.newest_step} if self.in_place else {}),
        }


def agree(
    carry: LiveState | None,
    died_at: float | None,
    *,
    group: dist.ProcessGroup,
    store: dist.Store | None,
    rank: int,
    members: list[int] | None = None,
    dropped: list[int] = (),
    took_over: list[list[int]] = (),
    collectives: Any = leaf_collectives,
) -> EpochStart:
    """Every rank, at the start of every epoch: one small all-gather says who survived with what
    and who is a replacement. ``members``: the epoch's torchrun ranks, in its rank order;
    ``dropped``: the failed epoch's members not back; ``took_over``: ``[lost, spare]`` pairs, a
    spare node's rank in a lost one's place (a newcomer, not a death of its own). Rank 0 also asks the job's store whether a
    failure recurs (a process of the same torchrun rank lost at the same step before, in this
    job): that ends the job with a clear error on every rank, since going on would repeat it."""
    mine = (
        carry.step if carry else -1,
        carry.last_committed if carry else None,
        carry.failed_seen_at if carry else None,
        died_at,
        len(carry.members) if carry else 0,
        carry.error if carry else "",
    )
    everyone = collectives.all_gather_object(mine, group)
    steps = [s for s, _, _, _, _, _ in everyone]
    newest = max(steps)
    replaced = [r for r, (_, _, _, d, _, _) in enumerate(everyone) if d is not None]
    deaths = [d for _, _, _, d, _, _ in everyone if d is not None]
    seen = [t for _, _, t, _, _, _ in everyone if t is not None]
    committed = [c for _, c, _, _, _, _ in everyone if c is not None]
    # The earliest sign of the death: its supervisor's poll, or a survivor's failed collective.
    died = min(deaths + seen) if deaths or seen else None
    epoch = EpochStart(
        replaced=replaced,
        newest_step=newest,
        source_rank=steps.index(newest) if newest >= 0 else None,
        last_committed=max(committed) if committed else None,
        died_at=died,
        detected_s=max(seen) - died if seen and died is not None else None,
        previous_world_size=max(w for _, _, _, _, w, _ in everyone) or None,
        receivers=tuple(r for r, s in enumerate(steps) if s != newest),
    )
    members = members if members is not None else list(range(len(everyone)))
    spares = {spare for _, spare in took_over}
    processes_lost = {members[r] for r in replaced} - spares  # a spare taking a place: no death
    lost = sorted(processes_lost | set(dropped)) if newest >= 0 else []
    # Every member back with its state: no peer was lost, whatever the error said (any DistError
    # reads as a loss). Once at a step it may be a transient reset; again there, it is not.
    errors = [e for _, _, _, _, _, e in everyone if e]
    unexplained = errors[0] if newest >= 0 and not lost and errors else None
    _refuse_recurring(
        lost,
        newest,
        group=group,
        store=store,
        rank=rank,
        unexplained=unexplained,
        collectives=collectives,
    )
    return epoch


def _refuse_recurring(
    lost: list[int],
    step: int,
    *,
    group: dist.ProcessGroup,
    store: dist.Store | None,
    rank: int,
    unexplained: str | None = None,
    collectives: Any = leaf_collectives,
) -> None:
    """``unexplained``: the error that ended an epoch none of whose members was lost."""
    verdict = ""
    if rank == 0 and store is not None:
        if store.check([RECURRING_KEY]):
            verdict = store.get(RECURRING_KEY).decode()
        if unexplained is not None and store.add(f"elastictrain/no-loss/step-{step}", 1) > 1:
            verdict = (
                f"a collective failed twice at step {step} with every member alive and back, so "
                f"it is no peer's loss: {unexplained}. Regrouping would only repeat it; fix its "
                "cause and relaunch"
            )
            store.set(RECURRING_KEY, verdict)
        for r in lost:
            if store.add(f"elastictrain/lost/rank-{r}/step-{step}", 1) > 1:
                verdict = (
                    f"rank {r}'s training process died twice at step {step} "
                    "(a failure that recurs there: a bad sample, a kernel or driver fault, a "
                    "memory limit): replacing it again would only repeat it. See that rank's log "
                    "for how it died, fix the cause, and relaunch"
                )
                store.set(RECURRING_KEY, verdict)
    verdict = collectives.broadcast_bytes(verdict.encode() if rank == 0 else None, group)
    verdict = bytes(verdict).decode()
    if verdict:
        raise RecurringFailureError(verdict)
