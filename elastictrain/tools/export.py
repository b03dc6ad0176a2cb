"""``python -m elastictrain export URL [--step N] -o model.safetensors|model.pt``: the model alone,
consolidated (sharded checkpoints too), for inference or fine-tuning elsewhere.

``.safetensors`` is what Hugging Face tooling loads (``safetensors.torch.load_file``); it is written
here directly (an 8-byte header length, a JSON header, the raw tensor bytes), so exporting needs no
extra package. ``.pt`` is a ``torch.save``d state dict, loadable with ``weights_only=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
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


def write_safetensors(tensors: dict[str, Any], path: str, metadata: dict[str, str]) -> None:
    """``tensors`` (CPU, dense) as a safetensors file, written to a temp name and renamed."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset, ordered = 0, []
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ConfigError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot hold.")
        data = t.detach().contiguous().cpu()
        nbytes = data.numel() * data.element_size()
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(data.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        ordered.append(data)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for data in ordered:
            if data.numel():
                f.write(_bytes_of(data))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _bytes_of(t: Any) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (numpy has no bfloat16: go
    through uint8)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m elastictrain export",
        description="Write a checkpoint's model (consolidated from all shards) to one file.",
    )
    p.add_argument("url")
    p.add_argument("--step", type=int, help="default: the newest checkpoint that verifies")
    p.add_argument("-o", "--output", required=True, help="model.safetensors or model.pt")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    kind = os.path.splitext(args.output)[1]
    if kind not in (".safetensors", ".pt"):
        raise ConfigError(
            f"-o {args.output!r}: the name must end in .safetensors (Hugging Face) or .pt "
            "(torch.save)."
        )
    import torch

    from elastictrain.checkpoint.inspection import load_checkpoint

    options = dict(storage.parse_option(kv) for kv in args.storage_option)
    state = load_checkpoint(args.url, step=args.step, storage_options=options)
    model = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    step = state["manifest"]["step"]
    if kind == ".safetensors":
        # Tensors that share storage (tied weights) are stored once each, as copies.
        write_safetensors(model, args.output, {"format": "pt", "step": str(step)})
    else:
        tmp = f"{args.output}.tmp-{os.getpid()}"
        torch.save(model, tmp)
        os.replace(tmp, args.output)
    total = sum(t.numel() * t.element_size() for t in model.values())
    print(f"exported step {step}: {len(model)} tensors, {total} bytes -> {args.output}")
    return 0
