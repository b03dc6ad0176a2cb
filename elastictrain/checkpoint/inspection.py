"""Loading a checkpoint from outside a run (the CLI subcommands live in ``cli``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import storage
from elastictrain.checkpoint import state as tstate


def load_checkpoint(
    url: str,
    step: int | None = None,
    map_location: Any = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A committed, verified checkpoint as a dict; ``"model"`` is the unwrapped module's state_dict.

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
