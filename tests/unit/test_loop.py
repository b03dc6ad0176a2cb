"""elastictrain.train.loop: one optimizer step (gradient accumulation)."""

from __future__ import annotations

import gc

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.task import Task
from elastictrain.train.data import GlobalBatchSampler
from elastictrain.train.loader import StepLoader
from elastictrain.train.precision import Precision


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

    from elastictrain.train.loop import Trainer

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
        # DDP's reducer holds the group. Left as a local, it died at the test's return, after
        # destroy_process_group: holding the group's last reference, ~ProcessGroupGloo joined
        # gloo's threads with the GIL held while one needed it to free its last work (a suite
        # run hung so for good, py-spy: Reducer dealloc -> ~ProcessGroupGloo -> thread join;
        # pytorch#56297). So it goes first, while the group lives.
        del model, ddp, opt, trainer, task, loader
        gc.collect()
    finally:
        dist.destroy_process_group()
