"""A rollback in the loop: every rank goes back to an earlier copy in the same processes, skips
the window that led to the fault, and trains on (``numerics`` decides; ``checkpoint.rollback``
loads the copy and retracts the newer ones). A fault that comes back before the run got past
where the last rollback was decided stops the job: going back again would loop."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from elastictrain.errors import NumericalFaultError
from elastictrain.observe.events import Event
from elastictrain.observe.metrics import RunningMeans
from elastictrain.step_list import format_steps
from elastictrain.train import numerics

if TYPE_CHECKING:  # the runner's; library mode's loop (``loop_guards``) shares the rest
    from elastictrain.checkpoint.state import TrainState
    from elastictrain.observe.progress import Progress
    from elastictrain.train.attempt import Attempt
    from elastictrain.train.loop import Trainer

logger = logging.getLogger(__name__)


class RollingRun(Protocol):
    """What a rollback changes of the training loop (``training._Run``)."""

    attempt: Attempt
    state: TrainState
    trainer: Trainer
    skips: numerics.Skips
    spikes: numerics.SpikeDetector
    progress: Progress
    completed: int
    rolled_back_at: int | None


def roll_back(run: RollingRun, back: numerics.Rollback, at: int) -> int:
    """Every rank, at step ``at``: back to the newest copy at or before ``back.not_after``, its
    window to be skipped; the step to go on from."""
    attempt, trainer, session = run.attempt, run.trainer, run.attempt.session
    refuse_recurring(back, run.rolled_back_at, session.last_committed)
    t0 = time.monotonic()
    resumed, retracted = session.roll_back(run.state, attempt.device, back.not_after)
    start = resumed.step
    window = back.window if back.window is not None else range(start, back.not_after + 1)
    trainer.skip_steps.update(dict.fromkeys(window, back.skip_reason()))
    loader = attempt.loader(start)
    if loader is not trainer.loader:
        trainer.loader.close()
    trainer.loader = loader
    trainer.means = RunningMeans(attempt.device)  # the undone steps' losses are no one's
    # The steps trained again are the new generation's, in the ledger as on storage.
    run.skips.sample_log = run.skips.sample_log.at(session.generation)
    trainer.on_share = run.skips.sample_log.record
    run.completed, run.rolled_back_at = start, at
    run.spikes.rolled_back(start)
    run.progress.rolled_back(start)
    announce(attempt.events, back, at, start, window, retracted, t0, attempt.env.is_rank0)
    return start


def refuse_recurring(back: numerics.Rollback, rolled_back_at: int | None, committed) -> None:
    """A fault back before the run got past where the last rollback was decided stops the job
    (``NumericalFaultError``, exit 10): going back again would only loop."""
    if rolled_back_at is not None and back.not_after <= rolled_back_at:
        raise NumericalFaultError(
            f"a {back.reason} at step {back.not_after}, before the run got past step "
            f"{rolled_back_at}, where the last rollback was decided: the fault came back, "
            "so going back again would only repeat it. Nothing non-finite was applied or "
            f"committed (newest committed step: {committed}); the rollback events "
            "name the steps skipped. Relaunch with a lower learning rate, or skip the steps."
        )


def announce(
    events, back: numerics.Rollback, at: int, start: int, window, retracted, t0: float, rank0: bool
) -> None:
    """The ``rollback`` event, and rank 0's line: the runner's and library mode's alike."""
    seconds = time.monotonic() - t0
    events.emit(
        Event.ROLLBACK,
        step=start,
        at_step=at,
        reason=back.reason,
        skipped=format_steps(window),
        retracted=retracted,
        seconds=round(seconds, 4),
    )
    if rank0:
        logger.warning(
            "ROLLED BACK (%s at step %d): every rank is back at step %d in %.2fs, in place; "
            "skipped: %s; retracted durable checkpoint(s): %s",
            back.reason,
            at,
            start,
            seconds,
            format_steps(window) or "none",
            retracted or "none",
        )
