"""Library mode's training loop that recovers in place (``CheckpointManager.run``): each step, and
on a peer's loss the next membership epoch through the process's driver, then the step in flight
redone on the state of the newest step any survivor holds.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.checkpoint.state.train_state import TrainState
from elastictrain.errors import EXIT_INIT_TIMEOUT
from elastictrain.inplace import epoch_end
from elastictrain.inplace.driver import EpochDriver
from elastictrain.inplace.members import LiveState, error_line
from elastictrain.observe.events import Event

logger = logging.getLogger(__name__)

TrainStep = Callable[[int, nn.Module], "dict[str, Any] | None"]


def run_steps(
    manager: Any,
    driver: EpochDriver | None,
    train_step: TrainStep,
    state: TrainState,
    *,
    start: int,
    stop: int,
    wrap: Callable[[nn.Module], nn.Module],
) -> dict[str, Any] | None:
    """Train steps ``start`` .. ``stop - 1`` with ``manager`` (library mode's
    ``CheckpointManager``); ``driver``: the process's epochs when they recover in place (None:
    a peer's loss is an error like any other). Returns the last step's ``extra``."""
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    net, step, extra, primed, first = wrap(model), start, manager.extra, False, True
    gate, guards = _gate(driver), manager.guards(model, start)
    t_loop = time.monotonic()
    while step < stop:
        try:
            if first:  # a stop told while this epoch formed ends it before a step, as the runner's
                manager.stop_if_told(step, TrainState(model, optimizer, scheduler, extra))
            if not primed:  # after each wrap; a peer lost meanwhile is recovered as below
                primed = prime_buckets(train_step, step, net, model, optimizer)
            back = None
            if step in guards.window:  # a rollback's window: drawn, not trained
                guards.skip(step)
            else:
                optimizer.zero_grad(set_to_none=True)
                extra = train_step(step, net)
                if gate is not None:  # CUDA: the step's collectives have run everywhere
                    gate()
                back = guards.update(step, TrainState(model, optimizer, scheduler, extra))
            back = back or guards.compared(step + 1, model)
            if back is not None:  # numerics: back to a copy, in place (``loop_guards``)
                resumed = guards.roll_back(back, TrainState(model, optimizer, scheduler), step)
                step, extra = resumed.step, resumed.extra
                continue
            step += 1  # completed: what this rank's state holds from here on
            if driver is not None:
                driver.at(step)
            if first:  # where a (re)start's time went, as the runner records it
                step_s = round(time.monotonic() - t_loop, 4)
                manager.emit(Event.FIRST_STEP, step=step, step_s=step_s)
                first = False
            manager.step(step, model, optimizer, scheduler, extra)
        except Exception as e:
            if driver is None or not driver.is_peer_loss(e):
                if driver is not None:
                    driver.fail(e)
                raise
            step = _recover(
                manager, driver, e, TrainState(model, optimizer, scheduler, extra), step
            )
            net, extra, primed, first = wrap(model), manager.extra, False, True
            gate, t_loop = _gate(driver), time.monotonic()
            guards = manager.guards(model, step)  # the new epoch's group and session
    return extra


def _gate(driver: EpochDriver | None):
    """The epoch's update gate (``epoch_end.update_gate``): built again for each epoch."""
    if driver is None or driver.epoch is None:
        return None
    return epoch_end.update_gate(driver.device, twins=False, end=driver.epoch.end)


def _recover(
    manager: Any, driver: EpochDriver, error: Exception, state: TrainState, step: int
) -> int:
    """A peer's process died during ``step``: the next epoch, resumed in place; its step."""
    captured = tstate.capture(state, step=step)
    carry = LiveState(step, captured, manager.last_committed, time.time())
    carry.error = error_line(error)
    logger.warning("a peer's training process is gone at step %d (%s); regrouping", step, error)
    driver.leave(carry, abandon=manager.abandon_epoch)
    with driver.recovering(in_place=True):
        if driver.form(carry, None) is None:
            logger.error(
                "rank %d: the other ranks went on without this one (back after replace_wait); "
                "exiting %d so torchrun restarts the group at full size",
                driver.env.rank,
                EXIT_INIT_TIMEOUT,
            )
            raise SystemExit(EXIT_INIT_TIMEOUT)
        manager.open_epoch()
        return manager.resume_epoch(state, carry).step


def prime_buckets(train_step, step: int, net: nn.Module, model: nn.Module, optimizer) -> bool:
    """DDP orders its gradient buckets anew after a wrapper's first backward, and past two ranks
    that order is gloo's summation order: a step redone right after a wrap (a recovery, a
    restart) would sum in another order than an uninterrupted run (about 2e-7 off at 4 ranks).
    So ``run`` primes them after each wrap, as the runner does (``loop.Trainer.prime_buckets``):
    one discarded ``train_step``, in eval mode, with torch's and Python's random state kept."""
    if not isinstance(net, nn.parallel.DistributedDataParallel):
        return True
    was_training, python_rng = net.training, random.getstate()
    cuda = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    net.eval()  # the wrapper and the model: dropout off, BatchNorm's statistics untouched
    try:
        with torch.random.fork_rng(devices=cuda):
            train_step(step, net)
    finally:
        random.setstate(python_rng)
        optimizer.zero_grad(set_to_none=True)
        net.train(was_training)
    return True
