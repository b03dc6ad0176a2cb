"""Loading a sharded checkpoint into a training state at this world size: plan what this rank
reads (:func:`plan_load`: index, unsharded rest, tables, checks, DCP's requests), then fill the
targets and the state (:func:`fill`), from wherever the byte ranges were fetched to. Also a
replicated (DDP) checkpoint into a sharded state. The reading itself is
:mod:`elastictrain.checkpoint.sharded.reader`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

import storage
from elastictrain.checkpoint.sharded.format import capture, is_sharded_checkpoint, join, split
from elastictrain.checkpoint.sharded.reader import (
    Index,
    ShardReader,
    check_fits,
    plan_reads,
    read_common,
)
from elastictrain.checkpoint.state import dcp
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.errors import CheckpointMismatchError


@dataclass
class PlannedLoad:
    """What a rank will read of a sharded checkpoint: its targets, and DCP's requests for them."""

    index: Index
    common: Any
    targets: dict[str, torch.Tensor]
    reader: ShardReader
    planner: LoadPlanner
    plan: LoadPlan

    def wanted(self) -> dict[str, tuple[list[str], tuple[tuple[int, int], ...]]]:
        """Per shard file: (its block digests, the byte ranges this rank reads of it)."""
        return {
            name: (table["blocks"], tuple(dict.fromkeys(ranges)))
            for name, table, _, ranges in self.reader.located(self.plan)
        }


def plan_load(
    state: tstate.TrainState,
    store: storage.VerifiedFiles,
    manifest: storage.Manifest,
    device: torch.device,
) -> PlannedLoad:
    """Read the index, the unsharded rest and the tables this rank needs; check the checkpoint
    fits; plan the reads. Nothing in ``state`` changes. Raises CheckpointMismatchError when it
    does not fit, CheckpointCorruptError when what was read does not verify."""
    where = f"step {manifest.step} under {store.safe_url}"
    index, common = read_common(store, manifest, device)
    check_fits(state, index, common, where)
    targets, _ = split(capture(state, step=0, targets=True))
    targets = dcp.without_optimizer_state(targets, common)
    missing = sorted(set(targets) - set(index.doc["tensors"]))
    if missing:
        raise CheckpointMismatchError(
            f"Checkpoint {where} does not fit this run: sharded tensors {missing[:5]} are not in "
            "it. Nothing was deleted. Use the same model, optimizer and Task.state."
        )
    reader = ShardReader(store, manifest, index)
    planner, plan = plan_reads(reader, targets)
    return PlannedLoad(index, common, targets, reader, planner, plan)


def fill(
    state: tstate.TrainState, planned: PlannedLoad, ranges_from: storage.VerifiedFiles | None = None
) -> tuple[dict[str, Any], int]:
    """Read the planned byte ranges (from ``ranges_from`` when given: where they were fetched
    to) into the targets, then into ``state``: (the payload, bytes read)."""
    reader = planned.reader
    if ranges_from is not None:
        reader.store = ranges_from
    reader.read_data(planned.plan, planned.planner).wait()
    payload = join(planned.common, planned.targets)
    dcp.load_state_dicts(state.model, state.optimizer, payload["model"], payload["optimizer"])
    return payload, reader.bytes_read


def load_into(
    state: tstate.TrainState,
    store: storage.VerifiedFiles,
    manifest: storage.Manifest,
    device: torch.device,
) -> tuple[dict[str, Any], int]:
    """Load a sharded checkpoint into ``state`` at this world size, this rank reading all it
    needs itself: (the payload, bytes read). Raises CheckpointMismatchError before changing
    anything when it does not fit, and CheckpointCorruptError when a byte range this rank reads
    does not verify."""
    if not is_sharded_checkpoint(manifest.metadata):
        return _load_replicated(state, store, manifest)
    return fill(state, plan_load(state, store, manifest, device))


def _load_replicated(
    state: tstate.TrainState, store: storage.VerifiedFiles, manifest: storage.Manifest
) -> tuple[dict[str, Any], int]:
    """A replicated (DDP) checkpoint resumed by a sharded run: every rank reads the whole state,
    verified, and DCP's ``set_state_dict`` keeps this rank's shards of it. (A run moves to FSDP
    because its model stops fitting a device; its state still fits the host's memory here.)"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    where = f"step {manifest.step} under {store.safe_url}"
    data = store.read_file(manifest, tstate.state_file_of(manifest.metadata))
    payload = tstate.from_bytes(bytearray(data), map_location="cpu")
    tstate.check_compatible(state, payload, where)
    dcp.load_state_dicts(
        state.model,
        state.optimizer,
        payload["model"],
        tstate.optimizer_by_name(state, payload["optimizer"], where),
        options=StateDictOptions(full_state_dict=True),
    )
    return payload, len(data)
