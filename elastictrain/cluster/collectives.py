"""The few collectives the runner and the checkpoint session use, over any group (``None``: a
process alone, without torch.distributed). A leaf: it knows nothing of how the groups were built.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist


def barrier(group: dist.ProcessGroup | None) -> None:
    """``group=None`` means a process alone, without torch.distributed (library mode)."""
    if group is not None:
        dist.barrier(group=group)


def broadcast_bytes(
    data: bytes | None, group: dist.ProcessGroup | None, src: int = 0
) -> bytes | bytearray:
    """Rank ``src``'s ``data`` on every rank (empty for None): storage is read once per job, not
    per rank.

    No copies beyond the receive buffer, and no numpy (torch does not depend on it).
    """
    if group is None:
        return data or b""
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    n = int(length.item())
    if n == 0:
        return b""
    if dist.get_rank() == src:
        with warnings.catch_warnings():
            # The source buffer is only read by broadcast; torch warns because bytes are immutable.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            dist.broadcast(torch.frombuffer(data, dtype=torch.uint8), src=src, group=group)
        return data
    out = bytearray(n)
    dist.broadcast(torch.frombuffer(out, dtype=torch.uint8), src=src, group=group)
    return out


def as_bytes_tensor(data: Any) -> torch.Tensor:
    """``data``'s buffer as a uint8 tensor, not copied: what point-to-point sends and receives
    move (a received buffer must be writable)."""
    import warnings

    with warnings.catch_warnings():  # sent buffers are only read
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0)


def broadcast_int(value: int, group: dist.ProcessGroup | None, src: int = 0) -> int:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=src, group=group)
    return int(t.item())


def max_int(value: int, group: dist.ProcessGroup | None) -> int:
    """The largest of every rank's ``value`` (e.g. the worst outcome)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def max_ints(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """The largest of every rank's value at each position, in one all-reduce."""
    if group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def all_gather_object(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in rank order (small, picklable values only)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
