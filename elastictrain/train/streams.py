"""Streaming datasets: a ``Task.dataset`` that is a ``torch.utils.data.IterableDataset``.

A stream cannot be indexed, so the map-style design (data as a function of seed, epoch and step)
does not apply. Instead:

- **Same world size: exact.** The stream implements ``state_dict()`` and ``load_state_dict()`` (the
  protocol of torchdata's ``StatefulDataLoader`` and Hugging Face ``datasets.IterableDataset``), and
  splits itself over ranks (Hugging Face's ``split_dataset_by_node``, WebDataset's
  ``split_by_node``) and over loader workers (``get_worker_info``), as any ``IterableDataset`` must.
  Each rank loads through torchdata's ``StatefulDataLoader``, whose state (its own, and every
  loader worker's dataset state) is this rank's position: saved per rank with every durable
  checkpoint, restored on resume, so a killed run continues bit for bit.
- **Another world size: exactly-once, where the stream allows it.** A stream that also implements
  ``seek(position, rank, world_size)`` can start at a global sample position: after the call it
  yields the global stream's samples ``position + rank``, ``position + rank + world_size``, ... .
  The runner calls it at every start (position 0 on a fresh run), so with in-process loading
  (``--num-workers 0``) the samples trained after step ``s`` are exactly the first ``s * batch``
  of the stream, at any world size, and a resume at another world size seeks to ``s * batch``.
  With loader workers the samples trained are not such a prefix (the workers interleave), so a
  world-size change is refused, as for a stream without ``seek``: exit 2, nothing loaded.

The global batch must divide over the ranks (and each rank's share over ``--grad-accum-steps``):
every rank takes the same number of samples per step, so no loss reweighting is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from elastictrain.errors import CheckpointMismatchError, ConfigError, DataLoadError
from elastictrain.train.data import Share
from elastictrain.train.loader import load_failed, start_workers

UNKNOWN = -1
"""A sample's global position where the runner cannot know it (loader workers interleave)."""


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def is_seekable(dataset: Any) -> bool:
    return callable(getattr(dataset, "seek", None))


def check_stream(dataset: Any, batch_size: int, world_size: int, micro_steps: int) -> None:
    """Everything the runner needs of a stream, checked at start before anything is written.

    Raises:
        ConfigError: the stream cannot be resumed exactly, or the batch does not divide.
    """
    missing = [
        m for m in ("state_dict", "load_state_dict") if not callable(getattr(dataset, m, None))
    ]
    if missing:
        raise ConfigError(
            f"Task.dataset is a torch.utils.data.IterableDataset ({type(dataset).__name__}) "
            f"without {' and '.join(f'{m}()' for m in missing)}: the runner could not resume it "
            "exactly. Implement state_dict()/load_state_dict() returning/taking its position "
            "(Hugging Face datasets.IterableDataset and torchdata's stateful datasets have them), "
            "and seek(position, rank, world_size) to resume at another world size; or give a "
            "map-style Dataset (__len__ and __getitem__)."
        )
    if batch_size % world_size:
        raise ConfigError(
            f"Task.batch_size {batch_size} does not divide over {world_size} ranks: with a stream "
            "(Task.dataset is an IterableDataset) every rank takes the same share of the global "
            "batch. Use a batch size that is a multiple of the world size."
        )
    if (batch_size // world_size) % micro_steps:
        raise ConfigError(
            f"--grad-accum-steps {micro_steps} does not divide each rank's share of the global "
            f"batch ({batch_size // world_size} samples) with a stream; pick a divisor."
        )


class StreamLoader:
    """This rank's micro-batches of a stream, through torchdata's ``StatefulDataLoader``; also
    this rank's position (``Task``-state-like: :meth:`state_dict`, :meth:`check_rank_states`,
    :meth:`load_rank_states`), checkpointed per rank. The same interface as ``StepLoader``."""

    def __init__(
        self,
        *,
        dataset: IterableDataset,
        batch_size: int,
        rank: int,
        world_size: int,
        micro_steps: int,
        collate_fn: Callable[[list[Any]], Any],
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        waiting: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError as e:
            raise ConfigError(
                "Task.dataset is a stream (IterableDataset); loading one needs torchdata's "
                "StatefulDataLoader: pip install 'elastictrain[streams]' (or torchdata)."
            ) from e
        check_stream(dataset, batch_size, world_size, micro_steps)
        self.dataset, self.batch_size = dataset, batch_size
        self.rank, self.world_size, self.micro_steps = rank, world_size, micro_steps
        self.per_micro = batch_size // world_size // micro_steps
        self.num_workers, self.waiting = num_workers, waiting
        self.seekable = is_seekable(dataset)
        # The samples trained so far are the stream's first step * batch_size: only when every
        # rank reads its own positions from a seek, in one iterator (no interleaving workers).
        self.prefix = self.seekable and num_workers == 0
        self._loader = StatefulDataLoader(
            dataset,
            batch_size=self.per_micro,
            collate_fn=collate_fn,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
        )
        self._it: Iterator[Any] | None = None
        self._start = 0
        self._loaded: dict[str, Any] | None = None
        self._primed: tuple[int, list[tuple[Share, Any]]] | None = None
        self._where = (
            f"{num_workers} loader workers (--num-workers)" if num_workers else "in-process loading"
        )

    # -- this rank's position, checkpointed per rank ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "loader": self._loader.state_dict(),
            "prefix": self.prefix,
            "num_workers": self.num_workers,
            "data": [self.rank, self.world_size],
        }

    def check_rank_states(self, states: list[dict[str, Any]], step: int, where: str) -> None:
        """Raise CheckpointMismatchError, before anything is loaded, when the saved positions
        cannot continue this stream exactly at this data-parallel size."""
        saved = _data_ranks(states)
        if all(size == self.world_size for _, size in saved):
            return
        if self.seekable and all(s.get("prefix") for s in states):
            return
        why = (
            "it has no seek(position, rank, world_size), so it cannot start at a global sample "
            "position"
            if not self.seekable
            else f"it was read with {max(s.get('num_workers', 0) for s in states)} loader "
            "workers (--num-workers), which interleave, so the samples trained are not the "
            "stream's first ones"
        )
        size = saved[0][1]
        raise CheckpointMismatchError(
            f"Checkpoint {where} (step {step}) was saved at data-parallel size {size}; this run "
            f"has {self.world_size}. Task.dataset is a stream (IterableDataset) and {why}: "
            "resuming would repeat or skip samples. Nothing was loaded or changed. Choices: "
            f"relaunch at data-parallel size {size}; or give the stream seek() and train with "
            "--num-workers 0; or start a new run (another --checkpoint-dir)."
        )

    def load_rank_states(self, states: list[dict[str, Any]], step: int) -> None:
        """Continue from ``states`` (every rank's, as saved), checked by :meth:`check_rank_states`:
        the position of this data-parallel rank, whichever rank of its tensor-parallel group
        saved it."""
        self._start = step
        self._loaded = next(
            (
                s
                for s, data in zip(states, _data_ranks(states), strict=True)
                if data == (self.rank, self.world_size)
            ),
            None,
        )

    # -- the StepLoader interface ---------------------------------------------------------------
    def start(self, step: int) -> None:
        """Position the stream for training from ``step`` (call once, before the first batch)."""
        if self.seekable:
            # Every start seeks (0 on a fresh run); the same world size then loads the exact state.
            self.dataset.seek(step * self.batch_size, self.rank, self.world_size)
        if self._loaded is not None:
            self._loader.load_state_dict(self._loaded["loader"])
        self._start = step

    def _positions(self, step: int, micro: int) -> torch.Tensor:
        if not self.prefix:
            return torch.full((self.per_micro,), UNKNOWN, dtype=torch.long)
        local = torch.arange(self.per_micro) + (step * self.micro_steps + micro) * self.per_micro
        return local * self.world_size + self.rank

    def next_step(self, step: int) -> list[tuple[Share, Any]]:
        if self._primed is not None and self._primed[0] == step:
            pieces, self._primed = self._primed[1], None
            return pieces
        if self._it is None:
            self._it = start_workers(self._loader)  # the workers start here, after resume
        out = []
        for micro in range(self.micro_steps):
            try:
                with self.waiting():
                    batch = next(self._it)
            except StopIteration:
                raise DataLoadError(
                    f"Task.dataset (a stream) ran out at step {step}: --max-steps needs "
                    "more data, or a stream that repeats."
                ) from None
            except Exception as e:
                raise load_failed(self._it, step, micro, self._where, e) from e
            out.append((Share(epoch=0, indices=self._positions(step, micro), weight=1.0), batch))
        return out

    def load_one(self, step: int) -> Any:
        """Step ``step``'s first micro-batch (DDP's bucket priming). A stream cannot be read
        twice, so the step's batches are kept for :meth:`next_step`."""
        self._primed = (step, self.next_step(step))
        return self._primed[1][0][1]

    def close(self) -> None:
        self._it = None


def _data_ranks(states: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(data-parallel rank, size) each saved position was read at; saved by rank, so a checkpoint
    from before data-parallel coordinates were recorded is rank ``i`` of ``len(states)``."""
    return [tuple(s.get("data", (i, len(states)))) for i, s in enumerate(states)]
