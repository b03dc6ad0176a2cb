"""``python -m elastictrain ls|verify|inspect|prune URL``: checkpoints from outside a run.

Every subcommand takes ``--storage-option KEY=VALUE`` and ``--json``, and works on any URL.
"""

from __future__ import annotations

import argparse
import datetime
import json
from typing import Any

import storage

SUBCOMMANDS = ("ls", "verify", "inspect", "prune")


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m elastictrain {name}", description=description)
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    return p


def _store(args: argparse.Namespace, *, write: bool = False) -> storage.CheckpointStore:
    """The store at ``args.url``, proven usable first: a missing bucket, rejected credentials or a
    dead endpoint get the runner's own one-line diagnosis within seconds, not a traceback."""
    options = dict(storage.parse_option(kv) for kv in args.storage_option)
    store = storage.open_store(args.url, storage_options=options)
    store.probe(write=write)
    return store


def _emit(args: argparse.Namespace, doc: dict[str, Any], text: str) -> None:
    print(json.dumps(doc, indent=1) if args.json else text)


def _when(ts: float | None) -> str:
    if not ts:
        return "?"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def ls(argv: list[str]) -> int:
    p = _parser("ls", "List committed checkpoints: step, time, bytes, world size, verified.")
    p.add_argument(
        "--no-verify", action="store_true", help="skip reading payloads to verify checksums"
    )
    args = p.parse_args(argv)
    store = _store(args)
    rows = []
    for c in store.list(verify=not args.no_verify):
        m = c.manifest
        rows.append(
            {
                "step": c.step,
                "time": m.created_at if m else None,
                "bytes": m.total_bytes if m else None,
                "world_size": m.metadata.get("world_size") if m else None,
                "generation": m.metadata.get("generation") if m else None,
                "shards": m.metadata.get("shards") if m else None,
                "verified": None if args.no_verify else c.ok,
                "error": c.error,
            }
        )
    lines = [
        f"{'step':>10}  {'time (UTC)':19}  {'bytes':>12}  {'world':>5}  {'shards':>6}  verified"
    ]
    for r in rows:
        verified = {True: "yes", False: f"NO: {r['error']}", None: "-"}[r["verified"]]
        lines.append(
            f"{r['step']:>10}  {_when(r['time']):19}  {str(r['bytes'] or '?'):>12}  "
            f"{str(r['world_size'] or '?'):>5}  {str(r['shards'] or '-'):>6}  {verified}"
        )
    if not rows:
        lines.append(f"(no committed checkpoints under {store.safe_url})")
    _emit(args, {"url": store.safe_url, "checkpoints": rows}, "\n".join(lines))
    return 0


def verify(argv: list[str]) -> int:
    p = _parser("verify", "Verify sizes and checksums; exit 1 if any checkpoint is bad.")
    p.add_argument("--step", type=int, help="only this step (default: every committed checkpoint)")
    args = p.parse_args(argv)
    store = _store(args)
    steps = [args.step] if args.step is not None else store.committed_steps()
    results = []
    for step in steps:
        try:
            store.read(step)
            results.append({"step": step, "ok": True, "error": None})
        except (storage.CheckpointCorruptError, storage.CheckpointNotFoundError) as e:
            results.append({"step": step, "ok": False, "error": str(e)})
    text = "\n".join(
        f"step {r['step']}: {'OK' if r['ok'] else 'BAD: ' + r['error']}" for r in results
    )
    _emit(args, {"url": store.safe_url, "results": results}, text or "(no committed checkpoints)")
    return 0 if all(r["ok"] for r in results) else 1


def _tensors(obj: Any, prefix: str = "") -> list[dict[str, Any]]:
    import torch  # only here: the other commands never load a payload

    if isinstance(obj, torch.Tensor):
        return [
            {
                "name": prefix,
                "shape": list(obj.shape),
                "dtype": str(obj.dtype).replace("torch.", ""),
                "bytes": obj.numel() * obj.element_size(),
            }
        ]
    if isinstance(obj, dict):
        return [
            t for k, v in obj.items() for t in _tensors(v, f"{prefix}.{k}" if prefix else str(k))
        ]
    if isinstance(obj, (list, tuple)):
        return [t for i, v in enumerate(obj) for t in _tensors(v, f"{prefix}[{i}]")]
    return []


def _sharded_tensors(store: storage.CheckpointStore, manifest: storage.Manifest) -> list[dict]:
    """Whole tensors' shapes from the index (and how many shards hold each), plus the unsharded
    rest from the common file's headers: no tensor data is read."""
    import torch

    from elastictrain.checkpoint.sharded import format as sharded
    from elastictrain.checkpoint.sharded import reader as shard_reader
    from elastictrain.checkpoint.state import train_state as tstate

    where = f"step {manifest.step}"
    index = shard_reader.Index.parse(
        store.read_file(manifest, manifest.metadata["index_file"]), where
    )
    with store.open_file(manifest.step, index.doc["common"]) as f:
        common = tstate.from_bytes_file(f, map_location="meta")
    metas = {
        fqn: torch.empty(t["size"], dtype=getattr(torch, t["dtype"]), device="meta")
        for fqn, t in index.doc["tensors"].items()
    }
    rows = _tensors(sharded.join(common, metas))
    chunks = {fqn.replace("/", "."): index.chunk_count(fqn) for fqn in index.doc["tensors"]}
    for row in rows:
        if row["name"] in chunks:
            row["shards"] = chunks[row["name"]]
    return rows


def inspect(argv: list[str]) -> int:
    p = _parser("inspect", "Show a checkpoint's manifest and tensors without loading the data.")
    p.add_argument("--step", type=int, help="default: the newest committed checkpoint")
    args = p.parse_args(argv)
    store = _store(args)
    step = args.step if args.step is not None else max(store.committed_steps(), default=None)
    manifest = store.read_manifest(step) if step is not None else None
    if manifest is None:
        raise storage.CheckpointNotFoundError(
            f"No committed checkpoint {step} under {store.safe_url!r}."
        )
    from elastictrain.checkpoint.sharded import (
        format as sharded,  # torch: this command reads a payload
    )
    from elastictrain.checkpoint.state import train_state as tstate

    if sharded.is_sharded_checkpoint(manifest.metadata):
        tensors = _sharded_tensors(store, manifest)
    else:
        # map_location="meta" builds tensors without storage: only the pickle and headers are read.
        with store.open_file(step, tstate.state_file_of(manifest.metadata)) as f:
            state = tstate.from_bytes_file(f, map_location="meta")
        tensors = _tensors(state)
    doc = {
        "url": store.safe_url,
        "step": step,
        "created_at": manifest.created_at,
        "files": {n: vars(e) for n, e in manifest.files.items()},
        "metadata": manifest.metadata,
        "tensors": tensors,
    }
    lines = [
        f"step {step}  committed {_when(manifest.created_at)} UTC  {manifest.total_bytes} bytes",
        f"metadata: {json.dumps(manifest.metadata, sort_keys=True)}",
    ]
    lines += [f"  file {n:40} {e.size:>12} bytes" for n, e in manifest.files.items()]
    lines += [
        f"  {t['name']:50} {str(t['shape']):20} {t['dtype']:10} {t['bytes']:>12}"
        + (f"  in {t['shards']} shards" if "shards" in t else "")
        for t in tensors
    ]
    _emit(args, doc, "\n".join(lines))
    return 0


def prune(argv: list[str]) -> int:
    p = _parser(
        "prune", "Apply a retention policy (never deletes the newest checkpoint that verifies)."
    )
    p.add_argument("--keep-last", type=int, required=True, metavar="K")
    p.add_argument("--keep-every-steps", type=int, metavar="M", help="also keep multiples of M")
    p.add_argument("--dry-run", action="store_true", help="only show what would be deleted")
    args = p.parse_args(argv)
    store = _store(args, write=not args.dry_run)
    newest = store.latest()
    if newest is None:
        _emit(
            args,
            {"url": store.safe_url, "deleted": [], "dry_run": args.dry_run},
            "nothing to prune: no checkpoint verifies",
        )
        return 0
    good = newest.manifest.step
    plan = store.retention_plan(args.keep_last, newest_good=good, keep_every=args.keep_every_steps)
    deleted = (
        plan
        if args.dry_run
        else store.apply_retention(
            args.keep_last, newest_good=good, keep_every=args.keep_every_steps
        )
    )
    verb = "would delete" if args.dry_run else "deleted"
    _emit(
        args,
        {"url": store.safe_url, "deleted": deleted, "dry_run": args.dry_run, "newest_good": good},
        f"{verb} steps {deleted or 'none'}; kept the newest good checkpoint {good}",
    )
    return 0


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    return {"ls": ls, "verify": verify, "inspect": inspect, "prune": prune}[command](rest)
