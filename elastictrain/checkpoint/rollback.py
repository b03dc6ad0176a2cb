"""A rollback: every rank goes back to the newest copy no newer than a step, in the same processes
and process groups (``train.numerics`` asks for one: a loss spike, a fault that did not clear).

The steps after that copy are now a history the run abandoned, so it is retracted first: every
committed copy newer than the bound, on every tier, is deleted, manifest first, as retention
deletes. The resume that follows is an ordinary one (node memory first, every byte verified) and
can only find a copy of the kept history; neither can a later restart. The rollback then claims a
new generation, like a restart: what it writes from here on has names no file had before, and
fences out anything the abandoned history still had in flight.
"""

from __future__ import annotations

import logging
import time

import torch

import storage
from elastictrain.checkpoint.checkpointer import Checkpointer, Resumed
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.cluster.collectives import all_gather_object, barrier, broadcast_int
from elastictrain.errors import NumericalFaultError

logger = logging.getLogger(__name__)


def roll_back(
    ckpt: Checkpointer, state: tstate.TrainState, device: torch.device, not_after: int
) -> tuple[Resumed, list[int]]:
    """Every rank together: ``state`` as of the newest copy at a step <= ``not_after``, and the
    steps retracted (the durable tier's, as rank 0 knows them). Raises NumericalFaultError, with
    nothing changed, when no tier holds such a copy."""
    for writer in (ckpt.writer, ckpt.local.writer if ckpt.local is not None else None):
        if writer is not None:
            writer.wait()  # a copy in flight lands first: it is retracted if it is too new
    durable = ckpt.store if ckpt.is_writer else None
    tiers = ckpt.local.own_stores() if ckpt.local is not None else []
    kept = [s for store in [durable, *tiers] if store for s in _steps(store) if s <= not_after]
    if not any(all_gather_object(bool(kept), ckpt.group)):
        raise NumericalFaultError(
            f"no tier holds a copy at or before step {not_after} to roll back to (durable "
            "checkpoints and node-memory copies are taken every --checkpoint-every-steps and "
            "--local-every-steps): take copies more often, or relaunch from the newest "
            "checkpoint with --skip-steps"
        )
    retracted = _retract(durable, not_after) if durable is not None else []
    for store in tiers:
        _retract(store, not_after)
    barrier(ckpt.group)
    if ckpt.local is not None:
        ckpt.local.schedule.last = None  # the steps run again: copies fall due again
    # A new generation, as a restart takes: rank 0's clock, as the handshake's (time.time_ns).
    ckpt.generation = broadcast_int(time.time_ns() if ckpt.is_writer else -1, ckpt.group)
    ckpt.begun = None
    ckpt.record.committed(None)
    resumed = ckpt.resume(state, device)
    if resumed.checkpoint_step is None:  # every copy it kept failed to verify: nothing to load
        raise NumericalFaultError(
            f"no copy at or before step {not_after} verified (each is reported as corrupt); "
            "relaunch from the newest checkpoint with --skip-steps"
        )
    ckpt.claim()
    return resumed, retracted


def _steps(store: storage.CheckpointStore) -> list[int]:
    try:
        return store.committed_steps()
    except storage.StorageError as e:
        logger.warning("rollback: cannot list %s: %s", store.safe_url, e)
        return []


def _retract(store: storage.CheckpointStore, not_after: int) -> list[int]:
    """Delete the committed copies newer than ``not_after``, newest first."""
    retracted = []
    for step in sorted((s for s in _steps(store) if s > not_after), reverse=True):
        store.delete(step)
        retracted.append(step)
    if retracted:
        logger.warning(
            "rollback: retracted step(s) %s under %s (the abandoned history)",
            sorted(retracted),
            store.safe_url,
        )
    return retracted
