"""elastictrain.task and the toy task: loading --task, and Task's contract."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.errors import ConfigError, TaskLoadError
from elastictrain.task import Task, build_task


def test_task_loading_errors():
    with pytest.raises(TaskLoadError, match="cannot import module 'no_such_module_xyz'"):
        build_task("no_such_module_xyz:make", {})
    with pytest.raises(TaskLoadError, match="has no callable 'nope'"):
        build_task("elastictrain.toy:nope", {})
    with pytest.raises(TaskLoadError, match="expected elastictrain.Task"):
        build_task("builtins:dict", {})


def test_toy_options():
    task = build_task(
        "elastictrain.toy:make_task",
        {"hidden": "16", "layers": "3", "dataset_size": "100", "batch_size": "10"},
    )
    assert task.model.net1.out_features == 16 and len(task.model.extra) == 2
    assert len(task.dataset) == 100 and task.batch_size == 10
    with pytest.raises(ConfigError, match="hidden='abc' is not a valid int"):
        build_task("elastictrain.toy:make_task", {"hidden": "abc"})
    with pytest.raises(ConfigError, match="Unknown toy --task-option"):
        build_task("elastictrain.toy:make_task", {"hiden": "3"})
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        build_task("elastictrain.toy:make_task", {"dataset_size": "5", "batch_size": "10"})
    # frozen_mb: that much more checkpoint, and nothing a step computes on or updates.
    frozen = build_task("elastictrain.toy:make_task", {"frozen_mb": "2"}).model.frozen.weight
    assert frozen.numel() * 4 == 2 << 20 and not frozen.requires_grad


def test_task_state_entries_need_the_stateful_methods():
    with pytest.raises(ConfigError, match=r"Task.state\['ema'\] is a dict"):
        Task(
            model=nn.Linear(1, 1),
            dataset=TensorDataset(torch.zeros(4, 1)),
            batch_size=2,
            make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            loss_fn=lambda m, b: m(b[0]).sum(),
            state={"ema": {}},
        )
