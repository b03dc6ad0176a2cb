"""elastictrain.observe.metrics: training means and evaluation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastictrain.errors import ConfigError
from elastictrain.observe.metrics import RunningMeans, evaluate


def test_running_means_are_sample_weighted_and_names_must_not_change():
    means = RunningMeans()
    means.add(torch.tensor(1.0), {"acc": 0.5}, samples=3)
    means.add(torch.tensor(3.0), {"acc": torch.tensor(1.0)}, samples=1)
    assert means.reduce(None) == pytest.approx({"loss": 1.5, "acc": 0.625})
    assert means.reduce(None) is None  # nothing since the last report
    with pytest.raises(ConfigError, match=r"returned metrics \['top5'\] after \['acc'\]"):
        means.add(torch.tensor(1.0), {"top5": 1.0}, samples=1)


def test_evaluate_runs_in_eval_mode_without_grad_and_restores_train_mode():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    seen = {}

    def fn(m):
        seen["training"], seen["grad"] = m.training, torch.is_grad_enabled()
        return {"score": torch.tensor(2.0)}

    assert evaluate(fn, model.train(), lambda: torch.autocast("cpu", enabled=False), None) == {
        "score": 2.0
    }
    assert seen == {"training": False, "grad": False} and model.training
