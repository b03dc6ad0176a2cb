"""This rank's micro-batches, step after step, loaded in-process or by DataLoader workers.

``data.GlobalBatchSampler`` decides which samples each rank trains on at each step; this module
only loads them. A step's share is cut into ``--grad-accum-steps`` contiguous micro-batches, and
each is one item of a ``torch.utils.data.DataLoader`` keyed by ``(step, micro, indices)``:

- the order is the runner's, whatever ``--num-workers`` is: the DataLoader returns items in the
  order of its sampler, and the loop checks every key it receives;
- each micro-batch loads under its own seed (``data.load_seed``), so its bytes, augmentations
  included, are the same in-process or in any worker, and after any restart;
- a restart builds the loader at the resume step; there is no loader state to checkpoint.

A worker that dies makes the DataLoader raise (exit 1, torchrun restarts the group); one that hangs
is caught by the hang watchdog, which the loop arms around every wait for a batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler

from elastictrain.errors import ConfigError, DataLoadError
from elastictrain.task import Task
from elastictrain.train.data import GlobalBatchSampler, Share, load_seed, seed_all, share_bounds


def micro_shares(
    sampler: GlobalBatchSampler, step: int, rank: int, world_size: int, micro_steps: int
) -> list[Share]:
    """This rank's share of ``step`` in ``micro_steps`` contiguous pieces. Each piece's weight
    turns its mean loss into its part of the global-batch mean once DDP averages over ranks."""
    share = sampler.share(step, rank, world_size)
    pieces = []
    for micro in range(micro_steps):
        start, end = share_bounds(len(share.indices), micro, micro_steps)
        pieces.append(
            Share(
                epoch=share.epoch,
                indices=share.indices[start:end],
                weight=(end - start) * world_size / sampler.batch_size,
            )
        )
    return pieces


def check_micro_steps(batch_size: int, world_size: int, micro_steps: int) -> None:
    smallest = batch_size // world_size
    if micro_steps > smallest:
        raise ConfigError(
            f"--grad-accum-steps {micro_steps} is more than the {smallest} samples the smallest "
            f"rank gets per step (global batch {batch_size} over {world_size} ranks): every "
            "micro-batch needs a sample. Lower --grad-accum-steps or raise the task's batch_size."
        )


class _Keys(Sampler):
    """``(step, micro, indices)`` for every micro-batch of steps ``[start, stop)``, in order."""

    def __init__(self, plan: Callable[[int], list[Share]], start: int, stop: int) -> None:
        self.plan, self.start, self.stop = plan, start, stop

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        for step in range(self.start, self.stop):
            for micro, piece in enumerate(self.plan(step)):
                yield step, micro, piece.indices.tolist()

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)


class _MicroBatches(Dataset):
    """Item ``(step, micro, indices)``: that micro-batch, collated, loaded under its own seed."""

    def __init__(self, task: Task, seed: int, rank: int) -> None:
        self.dataset, self.collate_fn = task.dataset, task.collate_fn
        self.seed, self.rank = seed, rank

    def __getitem__(self, key: tuple[int, int, list[int]]) -> tuple[tuple[int, int], Any]:
        step, micro, indices = key
        seed_all(load_seed(self.seed, step, self.rank, micro))
        return (step, micro), self.collate_fn([self.dataset[i] for i in indices])


def worker_init() -> Callable[[int], None]:
    """Every loader worker's start, for this process's DataLoaders (map-style or stream)."""
    return functools.partial(_worker_init, os.getpid())


def start_workers(loader: Any) -> Iterator[Any]:
    """``iter(loader)``, which forks its workers, with the garbage collector's objects frozen for
    the forks. Garbage this process has not collected yet (an ended membership epoch's process
    groups, in reference cycles) would otherwise be collected in a worker, whose copy of it has
    none of the threads its destructors join: the worker segfaults and fails the rank (seen in
    3-rank in-place jobs with 2 loader workers, killed three times: 4 runs of 4 before, 0 of 4
    after). Frozen objects are never collected in the worker; here they are unfrozen at once.
    (Python's documented pattern for fork without exec: ``gc.freeze`` right before it.)"""
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()


def _worker_init(parent_pid: int, worker_id: int) -> None:
    # Stop signals are the training process's to handle: torchrun stops a worker with killpg, so
    # its SIGTERM reaches the loader workers too, and one dying of it would crash the rank (the
    # DataLoader raises on a dead worker) instead of letting it commit its preemption checkpoint.
    # DataLoader set its own SIGTERM handler just before this; the workers end with their rank.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)


def _die_with_parent(parent_pid: int) -> None:
    """In each loader worker: die when the training process does, however it ends. A worker
    stuck in ``dataset[i]`` never reaches DataLoader's own parent check, so without this a hang
    exit (or a SIGKILL of the rank) would leave it running forever, holding memory and pipes."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def load_failed(
    it: Iterator[Any], step: int, micro: int, where: str, e: Exception
) -> DataLoadError:
    """The error for a failed load, once the iterator's workers are off torch's SIGCHLD watch.

    A dead worker surfaces as DataLoader's RuntimeError, or, caught mid-message, as a bare
    ConnectionResetError/EOFError; a dataset bug as its own exception. Name the step either way;
    the caller chains the cause (and its worker traceback)."""
    _stop_watching_workers(it)
    return DataLoadError(
        f"loading step {step} micro-batch {micro} failed ({where}): "
        f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    )


def _stop_watching_workers(it: Iterator[Any]) -> None:
    """Take a failed iterator's workers off torch's SIGCHLD watch. Its handler raises in the main
    thread wherever that is, once per failure: a pair of workers found dead by their broken pipe
    first would raise again inside the failure path this error starts (its report, its last words,
    a logging lock it holds), losing the report or hanging the exit. Torch forgets the workers
    itself when its handler is the one that raised; here the error came another way."""
    from torch.utils.data._utils.signal_handling import _remove_worker_pids

    with contextlib.suppress(Exception):  # never lets the cleanup hide the error
        if getattr(it, "_worker_pids_set", False):
            _remove_worker_pids(id(it))
            it._worker_pids_set = False  # type: ignore[attr-defined]


def _as_is(item: Any) -> Any:
    return item  # the batch is collated already; module-level so workers can unpickle it


class StepLoader:
    """Yields each step's micro-batches, from ``start`` on, with ``num_workers`` loading ahead."""

    def __init__(
        self,
        *,
        task: Task,
        sampler: GlobalBatchSampler,
        rank: int,
        world_size: int,
        micro_steps: int,
        seed: int,
        start: int,
        stop: int,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        waiting: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        """``waiting``: entered around every wait for a batch (the runner arms its watchdog)."""
        check_micro_steps(sampler.batch_size, world_size, micro_steps)
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.micro_steps, self.waiting = micro_steps, waiting
        self._items = _MicroBatches(task, seed, rank)
        # The key stream gets its own sampler: it runs ahead of the loop by the prefetch depth,
        # and sharing one would thrash the per-epoch permutation cache at epoch boundaries.
        ahead = GlobalBatchSampler(sampler.dataset_size, sampler.batch_size, sampler.seed)
        self._loader = DataLoader(
            self._items,
            batch_size=None,
            sampler=_Keys(self._plan_with(ahead), start, stop),
            collate_fn=_as_is,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=pin_memory,
            worker_init_fn=worker_init(),
        )
        self._it: Iterator[Any] | None = None
        self._where = (
            f"{num_workers} loader workers (--num-workers)" if num_workers else "in-process loading"
        )

    def _plan_with(self, sampler: GlobalBatchSampler) -> Callable[[int], list[Share]]:
        return lambda step: micro_shares(
            sampler, step, self.rank, self.world_size, self.micro_steps
        )

    def plan(self, step: int) -> list[Share]:
        return micro_shares(self.sampler, step, self.rank, self.world_size, self.micro_steps)

    def next_step(self, step: int) -> list[tuple[Share, Any]]:
        """Every micro-batch of ``step`` (the next step of the stream), with its share."""
        if self._it is None:
            self._it = start_workers(self._loader)  # the workers start here, after resume
        out = []
        for micro, piece in enumerate(self.plan(step)):
            try:
                with self.waiting():
                    key, batch = next(self._it)
            except Exception as e:
                raise load_failed(self._it, step, micro, self._where, e) from e
            if key != (step, micro):
                raise RuntimeError(
                    f"data loader out of order: expected step {step} micro-batch {micro}, got {key}"
                )
            out.append((piece, batch))
        return out

    def load_one(self, step: int) -> Any:
        """Step ``step``'s first micro-batch, loaded here (DDP's bucket priming)."""
        piece = self.plan(step)[0]
        return self._items[(step, 0, piece.indices.tolist())][1]

    def close(self) -> None:
        """Stop the workers (the iterator's shutdown joins them)."""
        self._it = None
