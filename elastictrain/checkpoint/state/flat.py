"""Training state as one flat file, staged in one reused host buffer.

A checkpoint must block training only for the copy of its tensors into host memory; everything
else (hashing, writing) can run in the background from that copy. So the state is flattened into
one contiguous buffer that is allocated once, touched once, and reused by every checkpoint (a fresh
allocation alone costs several times the copy, in page faults). The buffer's bytes *are* the file:

    [tensor bytes, each 64-byte aligned][skeleton][header JSON][u64 header length][MAGIC]

- the skeleton is the state's structure (dicts, lists, numbers: optimizer param groups, the step)
  with every tensor replaced by ``{"__et_tensor__": i}``, ``torch.save``d, and loaded back with
  ``weights_only=True``, so loading never runs pickled code;
- the header lists each tensor's dtype, shape, offset and size.

Reading is one sequential read and zero-copy views into it. On CUDA the copies go device to host
into pinned memory on a side stream; training's stream waits for them on the GPU, not on the host.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"ETFLAT01"
_TRAILER = struct.Struct("<Q8s")  # header length, magic
_ALIGN = 64
MARKER = "__et_tensor__"


def is_flat(data: bytes | bytearray | memoryview) -> bool:
    return len(data) >= _TRAILER.size and bytes(data[-len(MAGIC) :]) == MAGIC


def _flatten(tree: Any, tensors: list[torch.Tensor], names: list[str], path: str = "") -> Any:
    """``tree`` with each tensor replaced by a marker holding its index in ``tensors``; each
    tensor's path in the tree (``model.net1.weight``) goes to ``names``, for errors."""
    if isinstance(tree, torch.Tensor):
        if tree.layout != torch.strided or tree.is_quantized:
            raise TypeError(
                f"cannot checkpoint a {tree.layout} / quantized tensor; only dense tensors are "
                "supported (convert it in your task's state_dict)"
            )
        tensors.append(tree.detach())
        names.append(path)
        return {MARKER: len(tensors) - 1}
    prefix = f"{path}." if path else ""
    if isinstance(tree, dict):
        return type(tree)((k, _flatten(v, tensors, names, f"{prefix}{k}")) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_flatten(v, tensors, names, f"{prefix}{i}") for i, v in enumerate(tree))
    return tree


def _unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if len(tree) == 1 and MARKER in tree:
            return tensors[tree[MARKER]]
        return type(tree)((k, _unflatten(v, tensors)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unflatten(v, tensors) for v in tree)
    return tree


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class Snapshot:
    """A consistent copy of the state, ready to persist. ``data`` is the whole file; it aliases
    the staging buffer, so it is valid until the next snapshot."""

    data: memoryview
    tensor_bytes: int
    copy_done: list[Any] | None = None  # one CUDA event per device whose copies are in flight
    placement: list[tuple[int, int]] | None = None
    """(byte offset, byte length) of each tensor in the file, in the order they were found."""
    owner: torch.Tensor | None = None  # keeps the memory behind ``data`` alive
    tensors: list[tuple[str, str]] | None = None
    """(path in the state, dtype name) of each tensor, in the order of ``placement``."""

    def wait(self) -> None:
        """Block until the device-to-host copies have landed (no-op on CPU)."""
        for event in self.copy_done or ():
            event.synchronize()
        self.copy_done = None

    def non_finite(self) -> list[str]:
        """The paths of the floating-point tensors in this copy that hold a NaN or an infinity.
        Read from the copy itself, the bytes a checkpoint writes, after :meth:`wait`: a state
        that went bad after the copy was taken does not count, one that was bad in it does."""
        bad = []
        for (path, dtype), (offset, nbytes) in zip(
            self.tensors or (), self.placement or (), strict=True
        ):
            kind = getattr(torch, dtype)
            if not kind.is_floating_point or kind.itemsize == 1 or not nbytes:
                continue  # integers are always finite; float8 has no isfinite kernel on the CPU
            values = self.owner[offset : offset + nbytes].view(kind)
            if not bool(torch.isfinite(values).all()):
                bad.append(path)
        return bad


class Staging:
    """One reusable host buffer for snapshots of a state whose layout rarely changes."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._streams: dict[torch.device, Any] = {}  # one side stream per CUDA device

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def _ensure(self, size: int, pin: bool) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = None  # free the old one first: memory stays bounded by one copy
            # 1/16 slack, so a few more optimizer-state entries do not force a reallocation.
            buffer = torch.empty(size + size // 16 + (1 << 20), dtype=torch.uint8, pin_memory=pin)
            buffer.zero_()  # touch every page now, not during the first timed copy
            self.buffer = buffer
        return self.buffer

    def snapshot(self, state: Any) -> Snapshot:
        """Copy every tensor of ``state`` into the staging buffer and lay out the file around them.

        The caller must not modify the state until this returns (CPU) or, on CUDA, until its
        current stream has passed the copies, which this arranges: the copies run on a side stream
        that first waits for the current one, and the current stream then waits for them.
        """
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        skeleton = _flatten(state, tensors, names)
        buf = io.BytesIO()
        torch.save(skeleton, buf)
        skeleton_bytes = buf.getvalue()
        entries, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append([str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
            offset = _aligned(offset + nbytes)
        tensor_bytes = offset
        header = json.dumps(
            {
                "format": "elastictrain-flat/1",
                "tensors": entries,
                "skeleton_bytes": len(skeleton_bytes),
            },
            separators=(",", ":"),
        ).encode()
        total = tensor_bytes + len(skeleton_bytes) + len(header) + _TRAILER.size
        on_cuda = any(t.is_cuda for t in tensors)
        buffer = self._ensure(total, pin=on_cuda)
        copy_done = self._copy_on_side_streams(tensors, entries, buffer) if on_cuda else None
        for t, (_, shape, off, nbytes) in zip(tensors, entries, strict=True):
            if not t.is_cuda:  # also the CPU tensors of a CUDA state (Adam's ``step``)
                buffer[off : off + nbytes].view(t.dtype).view(shape).copy_(t)
        tail = skeleton_bytes + header + _TRAILER.pack(len(header), MAGIC)
        buffer[tensor_bytes:total].copy_(torch.frombuffer(bytearray(tail), dtype=torch.uint8))
        return Snapshot(
            data=_memoryview(buffer, total),
            tensor_bytes=tensor_bytes,
            copy_done=copy_done,
            placement=[(off, nbytes) for _, _, off, nbytes in entries],
            owner=buffer,
            tensors=[(name, entry[0]) for name, entry in zip(names, entries, strict=True)],
        )

    def _copy_on_side_streams(self, tensors, entries, buffer) -> list[Any]:
        """Start the device-to-host copies of the CUDA tensors, each on a side stream of its own
        device (a model spread over GPUs has one per device); one event per device marks them."""
        events = []
        for device in sorted({t.device for t in tensors if t.is_cuda}, key=str):
            with torch.cuda.device(device):
                stream = self._streams.setdefault(device, torch.cuda.Stream())
                current = torch.cuda.current_stream()
                stream.wait_stream(current)  # copy the state as of now, after the optimizer step
                with torch.cuda.stream(stream):
                    for t, (_, shape, off, nbytes) in zip(tensors, entries, strict=True):
                        if t.device == device:
                            dst = buffer[off : off + nbytes].view(t.dtype).view(shape)
                            dst.copy_(t, non_blocking=True)
                            t.record_stream(stream)
                current.wait_stream(stream)  # the next step may not touch them before the copies
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        return events


def _memoryview(buffer: torch.Tensor, total: int) -> memoryview:
    """A zero-copy byte view of the first ``total`` bytes of a CPU uint8 tensor (no numpy)."""
    import ctypes

    array = (ctypes.c_char * total).from_address(buffer.data_ptr())
    array.owner = buffer  # the view keeps the tensor's memory alive, whoever holds it
    return memoryview(array).cast("B")


def load(data: bytes | bytearray | memoryview, map_location: Any = "cpu") -> Any:
    """The state in a flat file, its tensors as views into ``data`` (copied once first when
    ``data`` is read-only), then moved by ``map_location``."""
    header_len, magic = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    if magic != MAGIC:
        raise ValueError("not an elastictrain flat checkpoint")
    header_end = len(data) - _TRAILER.size
    header = json.loads(bytes(data[header_end - header_len : header_end]))
    skeleton_start = header_end - header_len - header["skeleton_bytes"]
    skeleton = torch.load(
        io.BytesIO(bytes(data[skeleton_start : header_end - header_len])), weights_only=True
    )
    if isinstance(data, bytes):
        data = bytearray(data)  # frombuffer needs writable memory: restored tensors get updated
    whole = (
        torch.frombuffer(data, dtype=torch.uint8)
        if len(data)
        else torch.empty(0, dtype=torch.uint8)
    )
    tensors = []
    for dtype, shape, offset, nbytes in header["tensors"]:
        t = whole[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
        tensors.append(_to(t, map_location))
    return _unflatten(skeleton, tensors)


def read_layout(f: Any) -> tuple[Any, list[tuple[str, list[int], int, int]]]:
    """(the skeleton, each tensor's (dtype, shape, byte offset, byte length)) from a seekable flat
    file, reading only its tail: what a reader that takes one tensor at a time needs. A tensor's
    place in the skeleton is ``{MARKER: i}``, ``i`` its row in the table."""
    f.seek(-_TRAILER.size, io.SEEK_END)
    end = f.tell()
    header_len, magic = _TRAILER.unpack(f.read(_TRAILER.size))
    if magic != MAGIC:
        raise ValueError("not an elastictrain flat checkpoint")
    f.seek(end - header_len)
    header = json.loads(f.read(header_len))
    f.seek(end - header_len - header["skeleton_bytes"])
    skeleton = torch.load(io.BytesIO(f.read(header["skeleton_bytes"])), weights_only=True)
    return skeleton, [tuple(row) for row in header["tensors"]]


def tensor_index(node: Any) -> int | None:
    """The table row of a tensor's place in a skeleton from :func:`read_layout`; None otherwise."""
    if isinstance(node, dict) and len(node) == 1 and MARKER in node:
        return node[MARKER]
    return None


def load_meta(f: Any) -> Any:
    """The state's structure with ``meta`` tensors, from a seekable file, reading only its tail."""
    skeleton, table = read_layout(f)
    tensors = [
        torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        for dtype, shape, _, _ in table
    ]
    return _unflatten(skeleton, tensors)


def _to(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    if map_location is None or str(map_location) == "cpu":
        return t
    if str(map_location) == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    if callable(map_location) or isinstance(map_location, dict):
        raise TypeError("flat checkpoints take a device for map_location, not a function or dict")
    return t.to(map_location)
