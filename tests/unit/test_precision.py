"""elastictrain.train.precision: bf16 / fp16 autocast and the GradScaler."""

from __future__ import annotations

import torch
from torch import nn

from elastictrain.train.precision import Precision


def _model_and_opt():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_fp16_overflow_skips_the_step_and_is_counted():
    model, opt = _model_and_opt()
    precision = Precision("fp16", torch.device("cpu"))
    before = model.weight.detach().clone()
    with precision.autocast():
        loss = model(torch.randn(3, 4)).float().sum() * float("inf")
    precision.backward(loss)
    precision.step(opt)
    assert torch.equal(model.weight, before), "an overflowing step must not touch the weights"
    assert precision.take_skips() == 1 and precision.take_skips() == 0
    assert precision.scaler.get_scale() == 65536.0 / 2  # backed off


def test_bf16_runs_the_forward_under_autocast_on_cpu():
    model, _ = _model_and_opt()
    with Precision("bf16", torch.device("cpu")).autocast():
        assert model(torch.randn(3, 4)).dtype == torch.bfloat16
    with Precision("fp32", torch.device("cpu")).autocast():
        assert model(torch.randn(3, 4)).dtype == torch.float32
