"""elastictrain.checkpoint.state.train_state: what a checkpoint carries, and what it refuses to load."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from elastictrain.checkpoint.state.train_state import (
    DataFingerprint,
    TrainState,
    capture,
    check_compatible,
    check_plain,
    from_bytes,
    restore,
    to_bytes,
)
from elastictrain.errors import CheckpointMismatchError, ConfigError
from elastictrain.toy import ToyModel
from elastictrain.train.precision import Precision
from tests.helpers.rich_task import EMA


def _model_and_opt():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _trained_state(decay=0.5):
    model, opt = _model_and_opt()
    precision = Precision("fp16", torch.device("cpu"))
    ema = EMA(model, decay)
    for _ in range(3):
        precision.backward(model(torch.randn(3, 4)).sum())
        precision.step(opt)
        ema.update(model)
    return TrainState(model, opt, stateful={"ema": ema}, scaler=precision.scaler)


def test_extra_state_and_the_scaler_round_trip_exactly_through_the_flat_payload():
    saved = _trained_state()
    saved.scaler.update(1234.5)  # a scale no fresh scaler has
    payload = from_bytes(to_bytes(capture(saved, step=3)))
    fresh = _trained_state(decay=0.1)
    fresh.stateful["ema"].shadow["weight"].zero_()
    check_compatible(fresh, payload, "step 3")
    assert restore(fresh, payload) == 3
    a, b = saved.stateful["ema"], fresh.stateful["ema"]
    assert (b.decay, b.updates) == (a.decay, a.updates)
    assert all(torch.equal(a.shadow[k], b.shadow[k]) for k in a.shadow)
    assert fresh.scaler.state_dict() == saved.scaler.state_dict()
    assert fresh.scaler.get_scale() == 1234.5


def test_extra_state_names_must_match_on_resume():
    payload = from_bytes(to_bytes(capture(_trained_state(), step=3)))
    model, opt = _model_and_opt()
    other = TrainState(model, opt, stateful={"counter": EMA(model, 0.5)})
    with pytest.raises(
        CheckpointMismatchError, match=r"Task.state entries \['counter'\] vs \['ema'\]"
    ):
        check_compatible(other, payload, "step 3")


def test_state_a_checkpoint_cannot_carry_is_refused_naming_where():
    class Curriculum:
        pass

    with pytest.raises(
        ConfigError, match=r"Task.state\['c'\].state_dict\(\)\['level'\] is a Curriculum"
    ):
        check_plain(
            {"level": Curriculum(), "ok": [1, 2.0, "x", None]}, "Task.state['c'].state_dict()"
        )


FP = DataFingerprint(batch_size=64, dataset_size=4096, seed=0)


def _state(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    return opt, capture(TrainState(model, opt, fingerprint=FP), step=7)


def _fits(model, payload, fingerprint=FP, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    check_compatible(TrainState(model, opt, fingerprint=fingerprint, **kw), payload, "step 7")


def test_roundtrip_restores_everything():
    torch.manual_seed(0)
    model = ToyModel()
    opt, state = _state(model)
    loaded = from_bytes(to_bytes(state))
    model2 = ToyModel()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    state2 = TrainState(model2, opt2, fingerprint=FP)
    check_compatible(state2, loaded, "test")
    assert restore(state2, loaded) == 7
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        opt.state_dict()["state"][0]["momentum_buffer"],
        opt2.state_dict()["state"][0]["momentum_buffer"],
    )


def test_shape_mismatch_names_the_key():
    _, state = _state(ToyModel(hidden=10))
    with pytest.raises(
        CheckpointMismatchError, match=r"net1.weight: checkpoint \(10, 10\) vs model \(12, 10\)"
    ):
        _fits(ToyModel(hidden=12), from_bytes(to_bytes(state)))


def test_key_mismatch_names_the_keys():
    _, state = _state(ToyModel(layers=1))
    with pytest.raises(
        CheckpointMismatchError, match=r"missing keys \['extra.0.bias', 'extra.0.weight'\]"
    ):
        _fits(ToyModel(layers=2), from_bytes(to_bytes(state)))


def test_batch_size_change_is_a_mismatch():
    model = ToyModel()
    _, state = _state(model)
    with pytest.raises(CheckpointMismatchError, match="batch_size was 64 when saved, is 32 now"):
        _fits(model, state, DataFingerprint(32, 4096, 0))


def test_loading_refuses_pickled_code():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"model": Evil()}, buf)
    with pytest.raises(Exception, match="Weights only load failed"):
        from_bytes(buf.getvalue())


def test_a_numbered_optimizer_state_is_named_by_the_runs_own_parameter_order():
    from elastictrain.checkpoint.state.train_state import TrainState, optimizer_by_name

    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    named = optimizer_by_name(TrainState(model, optimizer), saved, "here")
    assert named["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
    assert torch.equal(
        named["state"]["net2.bias"]["momentum_buffer"], saved["state"][3]["momentum_buffer"]
    )
    fewer = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="holds 4 parameters, this run's 2"):
        optimizer_by_name(TrainState(model, fewer), saved, "here")
