"""The toy task (tensor-parallel under ``--mesh tp=N``: ``toy.shard``) with each rank's training
loss per step appended to ``LOSS_LOG/losses-r{rank}.txt`` (``--task-option loss_log=DIR``), so
a test can compare the losses of two layouts step by step. Every other option is the toy's.
:func:`log_losses` adds the same log to any task."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from elastictrain import toy
from elastictrain.cluster.env import read_env
from elastictrain.task import Task


def make_task(options: Mapping[str, str]) -> Task:
    folder = options.get("loss_log")
    task = toy.make_task({k: v for k, v in options.items() if k != "loss_log"})
    return task if folder is None else log_losses(task, folder)


def log_losses(task: Task, folder: str) -> Task:
    """``task`` with every rank's loss of each applied step appended to ``folder``."""
    path = os.path.join(folder, f"losses-r{read_env().rank}.txt")
    inner, after, last = task.loss_fn, task.after_step, []

    def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
        loss = inner(model, batch)
        if model.training:  # not DDP's discarded priming pass, which runs in eval mode
            last[:] = [float(loss)]
        return loss

    def after_step(done: int, model: torch.nn.Module) -> None:
        with open(path, "a") as f:
            f.write(f"{done} {last[0]!r}\n")
        if after is not None:
            after(done, model)

    task.loss_fn, task.after_step = loss_fn, after_step
    return task


def read_losses(folder: str, rank: int) -> dict[int, float]:
    """Step -> loss; a later attempt's line for a step replaces an earlier one's."""
    with open(os.path.join(folder, f"losses-r{rank}.txt")) as f:
        return {int(step): float(loss) for step, loss in (line.split() for line in f)}
