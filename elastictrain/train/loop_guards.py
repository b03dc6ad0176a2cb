"""Library mode's numerical guards, around the optimizer step that ``CheckpointManager.run``
takes after the user's ``train_step`` (its forward and backward): the runner's rules
(``numerics``, ``replicas``, ``rollback``), with what library mode cannot know left out.

- **A non-finite gradient is skipped on every rank, never applied**: no optimizer or scheduler
  step, a ``skip`` event. The verdict is one all-reduce of a flag (``train_step`` may reduce its
  gradients any way it likes, so a rank's own gradient is not trusted to carry another's NaN).
- **More than** ``max_consecutive_skips`` **in a row** roll every rank back to the newest copy at
  or before the first of them, and those steps are skipped: ``train_step`` is not called for
  them (its batch depends on the step alone). The same fault straight back stops the job
  (``NumericalFaultError``, exit 10).
- **Replicas compared** every ``compare_replicas_every`` steps (DDP: every rank holds the same
  parameters): a difference rolls every rank back to the last agreed step, skipping nothing; a
  rank outside a strict majority twice stops the job naming its host. Library mode has no spare
  nodes to evict a suspect to (the runner's ``--replace-in-place`` does).
- **Not here**: loss spikes (the loss is ``train_step``'s, not returned) and the sample ledger
  (the data is the user's). A plain loop that calls ``step`` itself gets only the commit check:
  no checkpoint holds a non-finite tensor.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain import knobs
from elastictrain.checkpoint.sharded.format import is_sharded
from elastictrain.checkpoint.state.train_state import TrainState
from elastictrain.train import numerics, replicas, rollback


class LoopGuards:
    """Every rank, one membership epoch of ``CheckpointManager.run`` (built again after an
    in-place recovery: the group and the session are the new epoch's)."""

    def __init__(
        self,
        session: Any,
        model: nn.Module,
        *,
        start: int,
        skip_nonfinite: bool = True,
        max_consecutive_skips: int = 3,
        compare_replicas_every: int | None = 100,
    ) -> None:
        alone = not (dist.is_available() and dist.is_initialized())
        rank, world = (0, 1) if alone else (dist.get_rank(), dist.get_world_size())
        group = None if alone else dist.group.WORLD
        self.session = session
        self.check = numerics.GradientCheck(sharded=True) if skip_nonfinite else None
        self.skips = numerics.Skips(
            limit=max_consecutive_skips,
            events=session.events,
            sample_log=None,
            group=group,
            data_rank=rank,
            rank=rank,
            committed=lambda: session.last_committed,
            library=True,
        )
        self.replicas = replicas.ReplicaCheck(
            None if is_sharded(model) else compare_replicas_every,  # FSDP: twins unknown here
            shape=None,
            rank=rank,
            world_size=world,
            group=group,
            events=session.events,
            host=socket.gethostname(),
            start=start,
        )
        self.window: dict[int, str] = {}
        """Steps a rollback skips: not trained, recorded as skipped."""
        self.rolled_back_at: int | None = None
        # chaos --fault nan|bitflip, as the runner's Trainer: a NaN in this rank's gradient at
        # those steps; one bit of a parameter flipped after the step, once in a process.
        self._nan_steps, self._flip_steps = knobs.nan_steps(), knobs.bitflip_steps()

    def update(self, step: int, state: TrainState) -> numerics.Rollback | None:
        """After ``train_step``'s backward: the optimizer and scheduler steps, unless the
        gradient is not finite (every rank alike); a rollback past the limit in a row."""
        model, optimizer = state.model, state.optimizer
        if step in self._nan_steps:
            _poison(model)
        if self.check is not None and not self.check.finite(model, None):
            optimizer.zero_grad(set_to_none=True)
            return self.skips.record(step, numerics.NON_FINITE, [], None)
        self.skips.applied()
        optimizer.step()
        if state.scheduler is not None:
            state.scheduler.step()
        if step in self._flip_steps:
            self._flip_steps = frozenset()
            replicas.flip_a_bit(model)
        return None

    def skip(self, step: int) -> None:
        """A step in a rollback's window: drawn, not trained, recorded."""
        self.skips.record(step, self.window[step], [], None)

    def compared(self, done: int, model: nn.Module) -> numerics.Rollback | None:
        """After step ``done``: a rollback when the replicas' digests differ (every rank)."""
        if not self.replicas.due(done):
            return None
        differ = self.replicas.compare(done, model)
        if differ is None:
            return None
        return numerics.Rollback(differ.agreed_at, [], replicas.DIFFER, differ.suspects)

    def roll_back(self, back: numerics.Rollback, state: TrainState, at: int):
        """Every rank: back to the newest copy at or before ``back.not_after`` (the session's
        rollback: the newer copies retracted, a new generation), its window to be skipped; the
        ``Resumed`` to go on from."""
        rollback.refuse_recurring(back, self.rolled_back_at, self.session.last_committed)
        t0 = time.monotonic()
        device = next(iter(state.model.parameters())).device
        resumed, retracted = self.session.roll_back(state, device, back.not_after)
        start = resumed.step
        window = back.window if back.window is not None else range(start, back.not_after + 1)
        self.window.update(dict.fromkeys(window, back.skip_reason()))
        self.rolled_back_at = at
        events, rank0 = self.session.events, self.session.is_rank0
        rollback.announce(events, back, at, start, window, retracted, t0, rank0)
        return resumed


@torch.no_grad()
def _poison(model: nn.Module) -> None:
    """chaos nan: this rank's gradient goes NaN, as a bad sample's would."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.view(-1)[:1].fill_(float("nan"))
            return
