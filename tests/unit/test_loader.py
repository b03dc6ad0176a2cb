"""elastictrain.train.loader: the step loader, with and without worker processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastictrain.task import Task
from elastictrain.train.data import GlobalBatchSampler
from elastictrain.train.loader import StepLoader


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


class _Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"sample {i} is missing from the shard index")
        return torch.zeros(1)


def test_loader_workers_give_the_same_batches_as_in_process_loading_and_after_a_restart():
    in_process, workers = _batches(0), _batches(2)
    assert len(in_process) == 12 and all(len(step) == 2 for step in in_process)
    for a, b in zip(in_process, workers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    restarted = _batches(2, start=7)  # a loader built at the resume step
    for a, b in zip(in_process[7:], restarted, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


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


def test_workers_dying_after_a_load_error_do_not_raise_again_into_the_failure_path():
    """Torch's SIGCHLD handler raises wherever the main thread is, for any watched worker that
    dies. Once a load has failed another way (here a dataset error; in CI a broken pipe from a
    pair of crashed workers) the workers' deaths must not raise again into the failure report:
    that lost the report and once hung the exit."""
    import os
    import signal
    import time

    from elastictrain.errors import DataLoadError

    loader = StepLoader(
        task=_linear_task(_Broken(), batch_size=64), sampler=GlobalBatchSampler(64, 64, seed=1),
        rank=0, world_size=1, micro_steps=1, seed=1, start=0, stop=2, num_workers=2,
    )  # fmt: skip
    try:
        with pytest.raises(DataLoadError, match=r"2 loader workers .*KeyError"):
            loader.next_step(0)
        for worker in loader._it._workers:
            os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the failure path, where a raise would land
            time.sleep(0.01)
    finally:
        loader.close()


class _CollectsGarbage(torch.utils.data.Dataset):
    """A loader worker that runs a full garbage collection as it loads, as any may."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        import gc

        gc.collect()
        return i


class _Destroyed:
    """Garbage in a reference cycle; its destructor records which process ran it (a process
    group's would join threads that a forked worker does not have)."""

    def __init__(self, record: str) -> None:
        self.record, self.cycle = record, self

    def __del__(self) -> None:
        import os

        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_garbage_left_by_the_training_process_is_never_collected_in_a_loader_worker(tmp_path):
    """An in-place epoch leaves its process groups as garbage in cycles. A loader worker forked
    before the training process collects them must not: their destructors segfaulted workers
    (3-rank in-place jobs with 2 loader workers, killed three times, 4 runs of 4)."""
    import gc
    import os

    from torch.utils.data import DataLoader

    from elastictrain.train.loader import start_workers

    record = str(tmp_path / "destroyed-in")
    gc.disable()  # so that it is still garbage, not yet collected, when the workers fork
    try:
        _Destroyed(record)
        it = start_workers(DataLoader(_CollectsGarbage(), batch_size=None, num_workers=2))
        assert sorted(int(x) for x in it) == [0, 1, 2, 3]  # each worker collected its garbage
        del it
    finally:
        gc.enable()
    gc.collect()
    with open(record) as f:
        assert [int(pid) for pid in f.read().split()] == [os.getpid()]  # here, and only here
