"""The parts real jobs need, one at a time: precision, extra state, metrics, eval, the loader,
TensorBoard. Their kill/resume guarantees are in tests/integration/test_real_jobs.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.checkpoint.state import (
    TrainState,
    capture,
    check_compatible,
    check_plain,
    from_bytes,
    restore,
    to_bytes,
)
from elastictrain.config import parse_args
from elastictrain.data import GlobalBatchSampler
from elastictrain.errors import CheckpointMismatchError, ConfigError
from elastictrain.loader import StepLoader
from elastictrain.observe.metrics import RunningMeans, evaluate
from elastictrain.precision import Precision
from elastictrain.task import Task
from tests.helpers.rich_task import EMA


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


class _Augmented(torch.utils.data.Dataset):
    """Random augmentation in __getitem__: torch and NumPy draws."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        import numpy as np

        return torch.tensor([float(i)]) + torch.rand(1) + float(np.random.rand())


def _linear_task(dataset, batch_size: int) -> Task:
    return Task(
        model=nn.Linear(1, 1),
        dataset=dataset,
        batch_size=batch_size,
        make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=lambda m, b: m(b).sum(),
    )


def _batches(num_workers: int, start: int = 0, accum: int = 2):
    task = _linear_task(_Augmented(), batch_size=8)
    loader = StepLoader(
        task=task,
        sampler=GlobalBatchSampler(64, 8, seed=1),
        rank=1,
        world_size=2,
        micro_steps=accum,
        seed=1,
        start=start,
        stop=12,
        num_workers=num_workers,
        prefetch_factor=3 if num_workers else None,
    )
    try:
        return [[b for _, b in loader.next_step(step)] for step in range(start, 12)]
    finally:
        loader.close()


def test_loader_workers_give_the_same_batches_as_in_process_loading_and_after_a_restart():
    in_process, workers = _batches(0), _batches(2)
    assert len(in_process) == 12 and all(len(step) == 2 for step in in_process)
    for a, b in zip(in_process, workers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    restarted = _batches(2, start=7)  # a loader built at the resume step
    for a, b in zip(in_process[7:], restarted, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--precision", "fp8"], "invalid choice"),
        (["--grad-accum-steps", "0"], "--grad-accum-steps must be a positive whole number, got 0"),
        (["--prefetch-factor", "4"], "--prefetch-factor 4 needs loader workers"),
        (["--num-workers", "-1"], "--num-workers must be 0 or more, got -1"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0, got 0.0"),
    ],
)
def test_bad_real_job_flags_name_the_flag(argv, message, capsys):
    try:
        parse_args(argv)
    except SystemExit:  # argparse's own choices check
        assert message in capsys.readouterr().err
    except ConfigError as e:
        assert message in str(e)
    else:
        pytest.fail(f"{argv} was accepted")


def test_tensorboard_curves_continue_after_a_restart_without_duplicate_steps(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    from elastictrain.observe.tensorboard import Scalars

    first = Scalars(str(tmp_path), resume_step=0, enabled=True)
    for step in range(1, 11):  # the crashed attempt got to step 10
        first.write(step, "train", {"loss": 1.0})
    first.close()
    second = Scalars(str(tmp_path), resume_step=6, enabled=True)  # resumed from checkpoint 6
    for step in range(7, 13):
        second.write(step, "train", {"loss": 2.0})
    second.close()

    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in points] == list(range(1, 13)), points
    assert [v for _, v in points] == [1.0] * 6 + [2.0] * 6


def _counting_hook(calls, bucket):
    """A DDP comm hook that counts the all-reduces it replaces (one process: nothing to sum)."""
    calls.append(1)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def test_accumulation_all_reduces_once_per_step_and_matches_the_whole_batch_gradient():
    """DDP's no_sync on all micro-batches but the last: one all-reduce per bucket per step, and
    the accumulated gradient is the whole-batch one."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastictrain.loop import Trainer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = {}
        for accum in (1, 4):
            torch.manual_seed(0)
            model = nn.Linear(3, 1)
            ddp = DDP(model)
            calls: list[int] = []
            ddp.register_comm_hook(calls, _counting_hook)
            data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
            task = Task(
                model=model,
                dataset=data,
                batch_size=16,
                make_optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
            )
            loader = StepLoader(
                task=task, sampler=GlobalBatchSampler(16, 16, seed=0), rank=0, world_size=1,
                micro_steps=accum, seed=0, start=0, stop=3,
            )  # fmt: skip
            opt = task.make_optimizer(ddp.parameters())
            trainer = Trainer(
                task=task, model=ddp, optimizer=opt, scheduler=None, loader=loader,
                precision=Precision("fp32", torch.device("cpu")), device=torch.device("cpu"),
                rank=0, seed=0,
            )  # fmt: skip
            for step in range(3):
                trainer.step(step)
            loader.close()
            assert len(calls) == 3, f"accum {accum}: {len(calls)} all-reduces in 3 steps"
            grads[accum] = model.weight.grad.clone()
        torch.testing.assert_close(grads[4], grads[1])
    finally:
        dist.destroy_process_group()


class _Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"sample {i} is missing from the shard index")
        return torch.zeros(1)


def test_a_dataset_error_names_the_step_and_keeps_its_cause():
    from elastictrain.errors import DataLoadError

    task = _linear_task(_Broken(), batch_size=64)
    loader = StepLoader(
        task=task, sampler=GlobalBatchSampler(64, 64, seed=1), rank=0, world_size=1,
        micro_steps=1, seed=1, start=0, stop=2,
    )  # fmt: skip
    with pytest.raises(
        DataLoadError, match=r"loading step 0 micro-batch 0 failed \(in-process"
    ) as e:
        loader.next_step(0)
    assert isinstance(e.value.__cause__, KeyError) and e.value.exit_code == 1
