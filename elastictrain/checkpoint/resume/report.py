"""Say where a resume's state came from: one INFO line, the ``resume`` event, and on a change of
world size the ``membership`` event."""

from __future__ import annotations

import logging

from elastictrain.checkpoint.api import Restored, Tier
from elastictrain.observe.events import Event, EventLog

logger = logging.getLogger(__name__)


def report_resume(
    events: EventLog,
    *,
    step: int,
    seconds: float,
    restored: Restored,
    world_size: int,
    generation: int,
    is_writer: bool,
) -> None:
    """Say where the resume's state came from: one INFO line, the ``resume`` event, and on a
    change of world size the ``membership`` event."""
    origin, nbytes, saved_world = restored.origin, restored.nbytes, restored.saved_world_size
    if origin.tier is Tier.FAST:
        logger.info(
            "resumed from the fast tier's copies of step %d (%d bytes from node memory, %d "
            "from other nodes, 0 from the durable tier; %.2fs; %d steps newer than its)",
            step,
            origin.local_bytes,
            origin.peer_bytes,
            seconds,
            origin.steps_saved(step),
        )
    elif origin.tier is Tier.LIVE:
        logger.info(
            "resumed in place from rank %d's memory at step %d (%d bytes, %.2fs; nothing read "
            "from storage)",
            origin.source_rank,
            step,
            nbytes,
            seconds,
        )
    elif origin.tier is Tier.LOCAL:
        logger.info(
            "resumed from the local checkpoint of step %d on rank %d (%d bytes, %.2fs; "
            "%d steps newer than the durable tier's)",
            step,
            origin.source_rank,
            nbytes,
            seconds,
            origin.steps_saved(step),
        )
    else:
        logger.info("resumed from checkpoint step %d (%d bytes, %.2fs)", step, nbytes, seconds)
    events.emit(
        Event.RESUME,
        fresh=False,
        step=step,
        bytes=nbytes,
        seconds=round(seconds, 4),
        world_size=world_size,
        saved_world_size=saved_world,
        generation=generation,
        **origin.event_fields(step),
    )
    if is_writer and saved_world is not None and saved_world != world_size:
        logger.warning(
            "membership change: world size %s -> %d, resuming from step %d; the global batch "
            "stays the same, per-rank shares change",
            saved_world,
            world_size,
            step,
        )
        events.emit(
            Event.MEMBERSHIP,
            old_world_size=saved_world,
            new_world_size=world_size,
            step=step,
        )
