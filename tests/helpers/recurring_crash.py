"""A task whose rank ``crash_rank`` dies by SIGKILL whenever it trains step ``crash_step``: a
failure that recurs at one step (a bad sample, a kernel fault), whoever runs that rank.

``--task tests.helpers.recurring_crash:make_task --task-option crash_rank=1 --task-option
crash_step=30``, the toy task's other options as usual. The step count travels in ``Task.state``,
so a replacement that resumes in place knows it too.
"""

from __future__ import annotations

import dataclasses
import os
import signal

from elastictrain.cluster.env import read_env
from elastictrain.toy import make_task as make_toy_task


class StepClock:
    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]


def make_task(options):
    options = dict(options)
    crash_rank, crash_step = int(options.pop("crash_rank")), int(options.pop("crash_step"))
    task = make_toy_task(options)
    clock, toy_loss = StepClock(), task.loss_fn
    doomed = read_env().rank == crash_rank

    def loss_fn(model, batch):
        if doomed and model.training and clock.done == crash_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return toy_loss(model, batch)

    def after_step(done, model):
        clock.done = done

    return dataclasses.replace(task, loss_fn=loss_fn, after_step=after_step, state={"clock": clock})
