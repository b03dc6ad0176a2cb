"""The model's tensors of a committed checkpoint, one at a time: what ``export`` streams, so its
memory stays near the largest tensor, not the whole model (or the optimizer beside it).

- Flat checkpoints (DDP): the state file is verified by one streamed read in constant memory, then
  each tensor is one ranged read at the offset the file's header gives.
- Sharded checkpoints (FSDP): each tensor is assembled from every rank's chunks through the same
  planner and block-verified ranged reads as a resume.

Loading never unpickles code: the flat file's skeleton is read with ``weights_only=True`` and the
index is JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import storage
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.sharded import reader as shard_reader
from elastictrain.checkpoint.state import flat
from elastictrain.checkpoint.state import train_state as tstate

logger = logging.getLogger(__name__)


@dataclass
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class ModelReader:
    """A committed checkpoint's model state_dict, read a tensor at a time with :meth:`read`."""

    step: int
    tensors: dict[str, TensorInfo]
    """Each tensor's dtype and shape, by state_dict key, in state_dict order."""
    tied: list[list[str]] = field(default_factory=list)
    """Keys that name one tensor (tied weights), as the training run recorded them."""
    config: dict[str, Any] | None = None
    """``Task.hf_config`` as the run saved it, if it gave one."""
    _read: Any = None

    def read(self, name: str) -> torch.Tensor:
        """One tensor, whole, on the CPU, verified; valid until the next ``read`` (the reader
        may reuse its memory), so copy it to keep it."""
        return self._read(name)


def open_model(
    url: str, step: int | None = None, storage_options: Mapping[str, Any] | None = None
) -> ModelReader:
    """The model of checkpoint ``step`` (default: the newest whose files verify) under ``url``.

    Raises:
        CheckpointNotFoundError: no committed checkpoint (at ``step``), or none verifies.
        CheckpointCorruptError: ``step`` was asked for and does not verify.
    """
    store = storage.open_store(url, storage_options=storage_options)
    manifests = [m for m in store.ranked_manifests() if step is None or m.step == step]
    if not manifests:
        raise storage.CheckpointNotFoundError(
            f"No committed checkpoint{'' if step is None else f' at step {step}'} under "
            f"{store.safe_url!r} (committed steps: {store.committed_steps() or 'none'})."
        )
    error: Exception | None = None
    for manifest in manifests:
        try:
            if sharded.is_sharded_checkpoint(manifest.metadata):
                return _sharded(store, manifest)
            return _flat(store, manifest)
        except storage.CheckpointCorruptError as e:
            if step is not None:
                raise
            logger.error("CORRUPT CHECKPOINT skipped, falling back to an older one: %s", e)
            error = e
    raise storage.CheckpointNotFoundError(
        f"No committed checkpoint under {store.safe_url!r} verifies (last error: {error})."
    )


def _flat(store: storage.CheckpointStore, manifest: storage.Manifest) -> ModelReader:
    name = tstate.state_file_of(manifest.metadata)
    store.check_file(manifest, name)
    with store.open_file(manifest.step, name) as f:
        if not _is_flat(f):  # an old torch.save file: it can only be loaded whole
            f.seek(0)
            whole = tstate.from_bytes(bytearray(f.read()))
            model = {k: v for k, v in whole["model"].items() if isinstance(v, torch.Tensor)}
            return ModelReader(
                step=manifest.step,
                tensors={k: TensorInfo(v.dtype, tuple(v.shape)) for k, v in model.items()},
                tied=whole.get("tied", []),
                config=whole.get("export_config"),
                _read=lambda key: model[key],
            )
        skeleton, table = flat.read_layout(f)
    rows = {
        key: row
        for key, node in skeleton["model"].items()
        if (row := flat.tensor_index(node)) is not None
    }

    def read(key: str) -> torch.Tensor:
        dtype, shape, offset, nbytes = table[rows[key]]
        with store.open_file(manifest.step, name) as f:
            f.seek(offset)
            data = bytearray(f.read(nbytes))
        if len(data) != nbytes:
            raise storage.CheckpointCorruptError(
                f"Checkpoint step {manifest.step} under {store.safe_url!r}: {name!r} ends inside "
                f"tensor {key!r}."
            )
        raw = (
            torch.frombuffer(data, dtype=torch.uint8)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw.view(getattr(torch, dtype)).view(shape)

    return ModelReader(
        step=manifest.step,
        tensors={
            k: TensorInfo(getattr(torch, table[r][0]), tuple(table[r][1])) for k, r in rows.items()
        },
        tied=skeleton.get("tied", []),
        config=skeleton.get("export_config"),
        _read=read,
    )


def _is_flat(f: Any) -> bool:
    import io

    f.seek(-len(flat.MAGIC), io.SEEK_END)
    return f.read() == flat.MAGIC


def _sharded(store: storage.CheckpointStore, manifest: storage.Manifest) -> ModelReader:
    store.check_sizes(manifest)
    index, common = shard_reader.read_common(store, manifest, "cpu")
    reader = shard_reader.ShardReader(store, manifest, index)
    prefix = "model/"
    saved = index.doc["tensors"]
    # state_dict order is the common file's: its model entry keeps every key, tensors as markers.
    order = [k for k in common.get("model", {}) if prefix + k in saved]
    order += [
        f[len(prefix) :] for f in saved if f.startswith(prefix) and f[len(prefix) :] not in order
    ]

    buffer = torch.empty(0, dtype=torch.uint8)

    def read(key: str) -> torch.Tensor:
        """Valid until the next read: one buffer, grown to the largest tensor, serves them all
        (a fresh allocation per tensor fragments the heap: docs/measurements.md)."""
        nonlocal buffer
        t = saved[prefix + key]
        dtype = getattr(torch, t["dtype"])
        numel = 1
        for d in t["size"]:
            numel *= d
        if buffer.numel() < numel * dtype.itemsize:
            buffer = torch.empty(numel * dtype.itemsize, dtype=torch.uint8)
        target = buffer[: numel * dtype.itemsize].view(dtype).view(t["size"])
        shard_reader.read_chunks(reader, {prefix + key: target})
        return target

    return ModelReader(
        step=manifest.step,
        tensors={
            k: TensorInfo(
                getattr(torch, saved[prefix + k]["dtype"]), tuple(saved[prefix + k]["size"])
            )
            for k in order
        },
        tied=common.get("tied", []),
        config=common.get("export_config"),
        _read=read,
    )
