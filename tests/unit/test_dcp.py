"""``checkpoint.state.dcp``: DCP's state dicts without its lr-0 step on an optimizer that has not
stepped. A sharded model (FSDP2 over a one-process gloo world) under AdamW."""

from __future__ import annotations

import torch
from torch import nn

from elastictrain.checkpoint.state import dcp


def _sharded_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _steps(optimizer: torch.optim.Optimizer) -> set[float]:
    return {float(s["step"]) for s in optimizer.state.values()}


def test_a_capture_leaves_an_optimizer_that_has_not_stepped_as_it_was(gloo_world):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _sharded_adam()
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    _, optim_sd = dcp.state_dicts(model, optimizer)
    assert optim_sd["state"] == {} and not optimizer.state  # described as it is: no state
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), before[k]), k
    _step(model, optimizer)
    assert _steps(optimizer) == {1.0}  # the first real step is Adam's first
    # What this guards against: DCP's own call gives Adam a step at lr 0 of its own.
    model, optimizer = _sharded_adam()
    get_state_dict(model, optimizer)
    _step(model, optimizer)
    assert _steps(optimizer) == {2.0}


def test_a_capture_after_a_step_holds_its_state_and_changes_nothing(gloo_world):
    model, optimizer = _sharded_adam()
    _step(model, optimizer)
    _, optim_sd = dcp.state_dicts(model, optimizer)
    assert {float(s["step"]) for s in optim_sd["state"].values()} == {1.0}
    assert _steps(optimizer) == {1.0}


def test_loading_a_state_saved_before_any_step_leaves_the_optimizer_without_one(gloo_world):
    model, optimizer = _sharded_adam()
    model_sd, optim_sd = dcp.state_dicts(model, optimizer)
    # The targets of a load get DCP's state to read into; the load of an empty one undoes it.
    _, targets = dcp.state_dicts(model, optimizer, targets=True)
    assert targets["state"] and optimizer.state
    dcp.load_state_dicts(model, optimizer, model_sd, optim_sd)
    assert not optimizer.state
    _step(model, optimizer)
    assert _steps(optimizer) == {1.0}
    # A state with steps in it loads as it was saved.
    _, stepped = dcp.state_dicts(model, optimizer)
    fresh_model, fresh = _sharded_adam()
    dcp.load_state_dicts(fresh_model, fresh, model.state_dict(), stepped)
    assert _steps(fresh) == {1.0}


def test_a_load_keeps_the_optimizer_targets_only_when_the_checkpoint_has_them():
    targets = {"model/w": 1, "optimizer/state/w/exp_avg": 2}
    common = {"optimizer": {"state": {}, "param_groups": []}}
    assert dcp.without_optimizer_state(targets, common) == {"model/w": 1}
    common["optimizer"]["state"] = {"w": {"exp_avg": {"__et_dtensor__": "x"}}}
    assert dcp.without_optimizer_state(targets, common) == targets
