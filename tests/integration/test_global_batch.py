"""An uneven split across ranks still produces the global-batch-mean gradient."""

from __future__ import annotations

import pytest
import torch

from elastictrain.task import build_task
from elastictrain.train.data import GlobalBatchSampler
from tests.helpers.launcher import final_state

OPTIONS = {"dataset_size": "100", "batch_size": "10", "lr": "0.1", "hidden": "16"}


def single_process_step(seed: int) -> dict[str, torch.Tensor]:
    """One SGD step on the whole global batch in one process: the ground truth."""
    torch.manual_seed(seed)
    task = build_task("elastictrain.toy:make_task", OPTIONS)
    optimizer = task.make_optimizer(task.model.parameters())
    indices = GlobalBatchSampler(len(task.dataset), task.batch_size, seed).global_batch(0)
    batch = task.collate_fn([task.dataset[i] for i in indices.tolist()])
    task.loss_fn(task.model, batch).backward()
    optimizer.step()
    return task.model.state_dict()


# 10 samples: shares 4/3/3; and 3/3/2/2, each cut into 2 micro-batches (2+1, 2+1, 1+1, 1+1).
@pytest.mark.parametrize("nproc,accum", [(3, 1), (4, 2)])
def test_uneven_shares_match_single_process_global_batch(launch, tmp_path, nproc, accum):
    opts = [a for k, v in OPTIONS.items() for a in ("--task-option", f"{k}={v}")]
    args = ["--checkpoint-dir", str(tmp_path / "c"), "--max-steps", "1", "--seed", "3", *opts]
    job = launch([*args, "--grad-accum-steps", str(accum)], nproc=nproc, plain=True)
    assert job.wait(120) == 0, job.log()[-3000:]
    got = final_state(str(tmp_path / "c"))["model"]
    want = single_process_step(seed=3)
    initial = build_task_state(seed=3)
    for k in want:
        assert not torch.equal(want[k], initial[k]), "the step must move the weights"
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def build_task_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return build_task("elastictrain.toy:make_task", OPTIONS).model.state_dict()
