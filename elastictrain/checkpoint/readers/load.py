"""Loading a checkpoint from outside a run (the CLI subcommands live in ``cli``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import storage
from elastictrain.checkpoint.sharded import format as sharded
from elastictrain.checkpoint.sharded import reader as shard_reader
from elastictrain.checkpoint.state import train_state as tstate

logger = logging.getLogger(__name__)


def load_checkpoint(
    url: str,
    step: int | None = None,
    map_location: Any = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A committed, verified checkpoint as a dict; ``"model"`` is the unwrapped module's state_dict.

    A sharded (FSDP) checkpoint comes back consolidated: every tensor whole, on the CPU (then
    ``map_location``), read from all the ranks' shards; its ``"optimizer"`` is keyed by parameter
    name, as ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives it.

    Args:
        url: the checkpoint location (a local path or any fsspec URL).
        step: which one; None picks the newest checkpoint that verifies.
        map_location: where the tensors go (a device).
        storage_options: fsspec options, e.g. ``endpoint_url``.

    Raises:
        CheckpointNotFoundError: no committed checkpoint (at ``step``).
        CheckpointCorruptError: the requested step fails verification.
        UnsafeCheckpointError: the payload would need unpickling code; nothing was executed.
    """
    store = storage.open_store(url, storage_options=storage_options)
    manifests = store.ranked_manifests()
    if step is not None:
        manifests = [m for m in manifests if m.step == step]
    if manifests and sharded.is_sharded_checkpoint(manifests[0].metadata):
        return _consolidated(store, manifests if step is None else manifests[:1], map_location)
    if step is None:
        ckpt = store.latest()
        if ckpt is None:
            raise storage.CheckpointNotFoundError(
                f"No committed checkpoint under {store.safe_url!r}."
            )
    else:
        ckpt = store.read(step)
    state = tstate.from_bytes(
        ckpt.files[tstate.state_file_of(ckpt.manifest.metadata)], map_location=map_location
    )
    state["manifest"] = {"step": ckpt.manifest.step, **ckpt.manifest.metadata}
    return state


def _consolidated(store: storage.CheckpointStore, manifests: list, map_location: Any) -> dict:
    """The first of ``manifests`` whose every chunk verifies, whole; the next on corruption."""
    error: Exception | None = None
    for manifest in manifests:
        try:
            store.check_sizes(manifest)
            state = shard_reader.consolidate(store, manifest, map_location)
        except storage.CheckpointCorruptError as e:
            if len(manifests) == 1:
                raise
            logger.error("CORRUPT CHECKPOINT skipped, falling back to an older one: %s", e)
            error = e
            continue
        state["manifest"] = {"step": manifest.step, **manifest.metadata}
        return state
    raise storage.CheckpointNotFoundError(
        f"No committed checkpoint under {store.safe_url!r} verifies (last error: {error})."
    )
