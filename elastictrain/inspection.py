"""Looking at checkpoints from outside a run: ``load_checkpoint`` and ``python -m elastictrain ls``."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Mapping
from typing import Any

import storage
from elastictrain import state as tstate


def load_checkpoint(
    url: str,
    step: int | None = None,
    map_location: Any = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A committed, verified checkpoint as a dict; ``"model"`` is the unwrapped module's state_dict.

    ``step=None`` picks the newest checkpoint that verifies.
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
    state = tstate.from_bytes(ckpt.files[tstate.STATE_FILE], map_location=map_location)
    state["manifest"] = {"step": ckpt.manifest.step, **ckpt.manifest.metadata}
    return state


def ls_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m elastictrain ls", description="List committed checkpoints."
    )
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    p.add_argument(
        "--no-verify", action="store_true", help="skip reading payloads to verify checksums"
    )
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    options = dict(kv.split("=", 1) for kv in args.storage_option)
    store = storage.open_store(args.url, storage_options=options)
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
                "verified": c.ok if not args.no_verify else None,
                "error": c.error,
            }
        )
    if args.json:
        json.dump({"url": store.safe_url, "checkpoints": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'step':>10}  {'time (UTC)':19}  {'bytes':>12}  {'world':>5}  verified")
    for r in rows:
        when = (
            datetime.datetime.fromtimestamp(r["time"], datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S"
            )
            if r["time"]
            else "?"
        )
        verified = {True: "yes", False: f"NO: {r['error']}", None: "-"}[r["verified"]]
        print(
            f"{r['step']:>10}  {when:19}  {r['bytes'] if r['bytes'] is not None else '?':>12}  "
            f"{r['world_size'] if r['world_size'] is not None else '?':>5}  {verified}"
        )
    if not rows:
        print(f"(no committed checkpoints under {store.safe_url})")
    return 0
