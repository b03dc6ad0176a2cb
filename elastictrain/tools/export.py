"""``python -m elastictrain export URL [--step N] -o OUT``: the model alone, consolidated (sharded
checkpoints too), for inference or fine-tuning elsewhere.

- ``OUT`` a folder: a Hugging Face model folder that ``from_pretrained`` loads. ``model.safetensors``,
  or above ``--max-shard-size`` shards ``model-0000k-of-0000N.safetensors`` with
  ``model.safetensors.index.json``, and ``config.json`` copied from ``--config`` (or written from
  ``Task.hf_config``, which every checkpoint of the run saved).
- ``OUT.safetensors``: one file (``safetensors.torch.load_file``, or ``load_model`` for a model with
  tied weights).
- ``OUT.pt``: a ``torch.save`` state dict, loadable with ``weights_only=True``.

Every path streams: one tensor is read, cast and written at a time, so memory stays near the
largest tensor, not the model (nor its optimizer state, which is never read). Tied weights (the
checkpoint records which keys share one tensor) are stored once, under their first state_dict key,
as Hugging Face does; ``.pt`` keeps every key, sharing one storage. Files are written to a temp
name and renamed, so an interrupted export never leaves a half-written file under the final name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import storage
from elastictrain.errors import ConfigError

_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
CASTS = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD = "5GB"  # Hugging Face's default for save_pretrained
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class _Info:
    """A tensor as it will be written: what a safetensors header needs."""

    dtype: str  # safetensors' name for it
    shape: tuple[int, ...]
    torch_dtype: Any
    nbytes: int


def write_safetensors(
    names: list[str],
    infos: dict[str, _Info],
    read: Callable[[str], Any],
    path: str,
    metadata: dict[str, str],
) -> int:
    """A safetensors file of ``names`` (dtype and shape from ``infos``), each tensor fetched by
    ``read(name)`` only when its bytes are due: the header (8-byte length, JSON) first, from the
    shapes alone. Written to a temp name and renamed. Returns the bytes of tensor data."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        info = infos[name]
        header[name] = {
            "dtype": info.dtype,
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name in names:
                data = read(name)
                if data.numel():
                    f.write(_bytes_of(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return offset


class _Plan:
    """What to write: the kept keys (tied ones once, unless ``keep_ties``), each tensor's output
    dtype, and a reader that casts."""

    def __init__(self, model: Any, cast: str | None, keep_ties: bool) -> None:
        import torch

        self.model = model
        aliases = {name for group in model.tied for name in group[1:]}
        self.names = [n for n in model.tensors if keep_ties or n not in aliases]
        self.aliases = {
            a: group[0] for group in model.tied for a in group[1:] if a in model.tensors
        }
        self.cast = getattr(torch, cast) if cast else None
        self.infos = {}
        for name, info in model.tensors.items():
            dtype = (
                self.cast if self.cast is not None and info.dtype.is_floating_point else info.dtype
            )
            name_of = str(dtype).removeprefix("torch.")
            if name_of not in _DTYPES:
                raise ConfigError(
                    f"tensor {name!r} has dtype {name_of}, which safetensors cannot hold."
                )
            numel = 1
            for d in info.shape:
                numel *= d
            self.infos[name] = _Info(_DTYPES[name_of], info.shape, dtype, numel * dtype.itemsize)

    def read(self, name: str) -> Any:
        t = self.model.read(name)
        return t.to(self.infos[name].torch_dtype) if t.dtype != self.infos[name].torch_dtype else t


def shard_groups(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Consecutive keys in files of at most ``max_bytes`` (a bigger tensor gets a file alone),
    as Hugging Face's ``save_pretrained`` splits them."""
    groups: list[list[str]] = [[]]
    total = 0
    for name in names:
        if groups[-1] and total + sizes[name] > max_bytes:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += sizes[name]
    return groups


def export_folder(
    model: Any, out: str, *, cast: str | None, max_shard_bytes: int, config: str | None
) -> tuple[int, int]:
    """A Hugging Face model folder. Returns (files written, tensor bytes)."""
    hf_config: dict[str, Any] = dict(model.config or {})  # the task's, saved with the checkpoint
    if config is not None:
        with open(config) as f:
            hf_config = json.load(f)
    # Hugging Face ties embeddings unless the config says not to; then it expects both keys.
    plan = _Plan(model, cast, keep_ties=hf_config.get("tie_word_embeddings", True) is False)
    os.makedirs(out, exist_ok=True)
    sizes = {n: plan.infos[n].nbytes for n in plan.names}
    groups = shard_groups(plan.names, sizes, max_shard_bytes)
    metadata = {"format": "pt"}  # what from_pretrained checks
    files = (
        [SINGLE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    total = 0
    for group, name in zip(groups, files, strict=True):
        total += write_safetensors(group, plan.infos, plan.read, os.path.join(out, name), metadata)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: f for group, f in zip(groups, files, strict=True) for n in group},
        }
        _write_text(os.path.join(out, INDEX), json.dumps(index, indent=2, sort_keys=True) + "\n")
    # A previous export's files that this one does not replace would be loaded beside it.
    written = {*files, INDEX} if len(groups) > 1 else set(files)
    for stale in os.listdir(out):
        if (_SHARD_NAME.fullmatch(stale) or stale in (SINGLE, INDEX)) and stale not in written:
            os.unlink(os.path.join(out, stale))
    if config is not None:
        shutil.copyfile(config, os.path.join(out, "config.json"))
    elif hf_config:
        _write_text(os.path.join(out, "config.json"), json.dumps(hf_config, indent=2) + "\n")
    return len(files), total


def export_pt(model: Any, out: str, *, cast: str | None) -> int:
    """``torch.save`` of the state dict, written without holding it: torch writes the archive
    with every storage's place reserved (``skip_data``, shapes from fake tensors), then each
    tensor's bytes go into its place, one tensor at a time. Tied keys share one storage."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    plan = _Plan(model, cast, keep_ties=True)
    fakes: dict[str, Any] = {}
    with FakeTensorMode():
        for name in model.tensors:
            if name not in plan.aliases:
                info = plan.infos[name]
                fakes[name] = torch.empty(info.shape, dtype=info.torch_dtype)
    skeleton = {n: fakes[plan.aliases.get(n, n)] for n in model.tensors}
    # torch names storages data/0, data/1, ... in the order the pickler first meets them.
    storages = list(dict.fromkeys(plan.aliases.get(n, n) for n in model.tensors))
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, tmp)
        archive = torch._C.PyTorchFileReader(tmp)
        with open(tmp, "r+b") as f:
            for key, name in enumerate(storages):
                offset = archive.get_record_offset(f"data/{key}")
                data = plan.read(name)
                if data.numel():
                    os.pwrite(f.fileno(), _bytes_of(data.contiguous()), offset)
            os.fsync(f.fileno())
        del archive
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return sum(plan.infos[n].nbytes for n in storages)


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _bytes_of(t: Any) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (numpy has no bfloat16: go
    through uint8)."""
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _kind(output: str) -> str:
    ext = os.path.splitext(output)[1]
    if ext in (".safetensors", ".pt"):
        return ext
    if ext and not os.path.isdir(output):
        raise ConfigError(
            f"-o {output!r}: give a folder (a Hugging Face model folder), a name ending in "
            ".safetensors (one file) or one ending in .pt (torch.save)."
        )
    return "folder"


def _args(argv: list[str]) -> argparse.Namespace:
    from elastictrain.tools.sizes import parse_size

    p = argparse.ArgumentParser(
        prog="python -m elastictrain export",
        description="Write a checkpoint's model (consolidated from all shards), one tensor at a "
        "time: a Hugging Face folder, one .safetensors file, or a .pt file.",
    )
    p.add_argument("url")
    p.add_argument("--step", type=int, help="default: the newest checkpoint that verifies")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="a folder (Hugging Face: model*.safetensors, index, config.json), "
        "model.safetensors, or model.pt",
    )
    p.add_argument("--dtype", choices=CASTS, help="cast floating-point tensors (default: as saved)")
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size(DEFAULT_MAX_SHARD),
        metavar="SIZE",
        help=f"folder only: the most bytes per safetensors file (default {DEFAULT_MAX_SHARD})",
    )
    p.add_argument(
        "--config",
        help="folder only: a config.json to copy beside the weights (default: the task's "
        "Task.hf_config, saved with the checkpoint)",
    )
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _args(argv)
    kind = _kind(args.output)
    if kind != "folder" and args.config is not None:
        raise ConfigError(f"--config {args.config!r} goes with a folder -o, not {args.output!r}.")
    if args.config is not None and not os.path.isfile(args.config):
        raise ConfigError(f"--config {args.config!r}: no such file.")
    from elastictrain.checkpoint.readers.model import open_model

    options = dict(storage.parse_option(kv) for kv in args.storage_option)
    model = open_model(args.url, step=args.step, storage_options=options)
    if kind == "folder":
        files, total = export_folder(
            model,
            args.output,
            cast=args.dtype,
            max_shard_bytes=args.max_shard_size,
            config=args.config,
        )
        where = f"{args.output} ({files} safetensors file{'s' if files > 1 else ''})"
    elif kind == ".safetensors":
        plan = _Plan(model, args.dtype, keep_ties=False)
        total = write_safetensors(
            plan.names,
            plan.infos,
            plan.read,
            args.output,
            {"format": "pt", "step": str(model.step)},
        )
        where = args.output
    else:
        total = export_pt(model, args.output, cast=args.dtype)
        where = args.output
    tied = sum(len(g) - 1 for g in model.tied)
    print(
        f"exported step {model.step}: {len(model.tensors)} tensors"
        f"{f' ({tied} tied, stored once)' if tied else ''}, {total} bytes -> {where}"
    )
    return 0
