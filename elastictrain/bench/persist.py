"""``python -m elastictrain bench persist``: what a checkpoint costs on your storage, side by side.

One synthetic state of ``--size`` bytes (a model plus Adam-like moments, float32), measured in one
run against the same storage, each figure the median of ``--repeats``:

Each elastictrain figure is measured in back-to-back pairs with its floor, alternating which goes
first, and reported as the median of the per-pair ratios with their spread (flagged when too wide
to trust):

- ``copy_s``: the memcpy floor, a copy of every tensor into warm, preallocated buffers
- ``raw_write_gbps`` / ``raw_read_gbps``: writing (and fsync) / reading the same number of bytes
  as one file, with nothing else; local reads start from a cold page cache (``posix_fadvise``)
- ``torch_save_s``: the tutorial's blocking ``torch.save`` (+ fsync)
- ``dcp_save_s``, ``dcp_async_blocked_s``: ``torch.distributed.checkpoint`` save / async_save
- ``elastictrain_blocked_s``: what the training loop waits for (the snapshot into the reused
  staging buffer); ``elastictrain_persist_s``: the background part (hash, write, manifest)
- ``load_s``: read, verify and rebuild the state
- ``step_inflation``: the toy task's step time while a background persist runs, vs without
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

import storage
from elastictrain.bench.child import drop_cache
from elastictrain.bench.state import moved_to, synthetic_state, tensors_in
from elastictrain.bench.timing import median_of, paired, timed
from elastictrain.checkpoint.state import flat as staging
from elastictrain.checkpoint.state.train_state import from_bytes


class Bench:
    def __init__(
        self, url: str, options: dict[str, Any], size: int, repeats: int, device: str = "cpu"
    ) -> None:
        self.root = f"{url.rstrip('/')}/elastictrain-bench-{uuid.uuid4().hex[:8]}"
        self.options = options
        self.store = storage.open_store(self.root, storage_options=options)
        self.local = storage.urls.is_local(url)
        self.fs, self.fs_root = storage.urls.open_url(self.root, options)
        self.repeats = repeats
        self.device = torch.device(device)
        # On a GPU the state lives in device memory, as a model's does: every figure then
        # includes the device-to-host copy (into pinned memory for elastictrain).
        self.state = moved_to(synthetic_state(size), self.device)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors_in(self.state))
        if self.local:
            os.makedirs(self.fs_root, exist_ok=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.fs_root, name) if self.local else f"{self.fs_root}/{name}"

    # -- the floors --------------------------------------------------------------------------
    def _raw_write(self, path: str, data: memoryview) -> float:
        """Write ``data`` as one new file, and nothing else (plus fsync on a local disk)."""
        t0 = time.perf_counter()
        if self.local:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.pipe_file(path, bytes(data))
        return time.perf_counter() - t0

    def _raw_read(self, path: str, cold: bool = True) -> float:
        """Read one file, and nothing else: unbuffered, into unzeroed memory, 4 MB at a time."""
        if self.local and cold:
            drop_cache(path)
        t0 = time.perf_counter()
        if self.local:
            view, off = memoryview(mmap.mmap(-1, os.path.getsize(path))), 0
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(view[off : off + (4 << 20)]):
                    off += n
        else:
            self.fs.cat_file(path)
        return time.perf_counter() - t0

    # -- the alternatives --------------------------------------------------------------------
    def torch_save_s(self) -> float:
        path = self._path("torch_save.pt")

        def once() -> float:
            t0 = time.perf_counter()
            with self.fs.open(path, "wb") as f:
                torch.save(self.state, f)
                if self.local:
                    f.flush()
                    os.fsync(f.fileno())
            return time.perf_counter() - t0

        t = median_of(once, self.repeats)
        self.fs.rm(path)
        return t

    def dcp(self) -> tuple[float | None, float | None]:
        """(save_s, async_blocked_s); None where DCP cannot write to this location."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if not self.local:
            return None, None  # DCP's fsspec writer is not a public API; compare on local disk
        try:
            import numpy  # noqa: F401 - DCP's file writer needs it; torch does not depend on it
        except ImportError:
            print(
                "DCP figures skipped: its writer needs numpy (pip install numpy)", file=sys.stderr
            )
            return None, None
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        state = {"model": self.state["model"], "optim": self.state["optimizer"]["state"]}
        saves, blocked = [], []
        for i in range(self.repeats):
            saves.append(timed(lambda i=i: dcp.save(state, checkpoint_id=self._path(f"dcp{i}"))))
            t0 = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=self._path(f"dcp-async{i}"))
            blocked.append(time.perf_counter() - t0)
            (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        for i in range(self.repeats):
            self.fs.rm(self._path(f"dcp{i}"), recursive=True)
            self.fs.rm(self._path(f"dcp-async{i}"), recursive=True)
        return statistics.median(saves), statistics.median(blocked)

    # -- elastictrain, each figure paired with its floor --------------------------------------
    def elastictrain(self) -> dict[str, Any]:
        """Each of our figures beside its floor, in pairs on the same bytes, alternating which
        goes first: the loop blocked by a snapshot / the copy into warm buffers; persist / a raw
        write; load + verify / a raw read (both from a cold cache), and the same two reads from
        the page cache, which shows what the disk itself limits. The per-pair ratio's median and
        spread are steadier than a ratio of medians on a machine whose speed drifts."""
        buffers = staging.Staging()
        buffers.snapshot(self.state)  # first use allocates and touches the buffer, once per run
        copy = self._warm_copy()
        pairs: dict[str, list[tuple[float, float]]] = {
            "blocked": [],
            "persist": [],
            "load": [],
            "load_warm": [],
        }

        def blocked() -> float:
            t0 = time.perf_counter()
            # On a GPU the copies run on a side stream and only the GPU waits for them; counted
            # here until they land, the most a training step could be held up.
            buffers.snapshot(self.state).wait()
            return time.perf_counter() - t0

        for step in range(1, self.repeats + 1):
            ours_first = step % 2 == 0
            pairs["blocked"].append(paired(blocked, copy, ours_first))
            snap = buffers.snapshot(self.state)
            raw = self._path(f"raw-{step}.bin")

            def raw_write(r=raw, d=snap.data) -> float:
                if self.local:
                    os.sync()  # on a disk still writing back, the second writer would pay
                seconds = self._raw_write(r, d)
                self.fs.rm(r)  # both writers draw on the same free pages (tmpfs, page cache)
                return seconds

            def persist(s=step, d=snap.data) -> float:
                if self.local:
                    os.sync()
                return timed(lambda: self.store.commit(s, {"state.bin": d}, {}))

            pairs["persist"].append(paired(persist, raw_write, ours_first))
            payload = self._path(f"step-{step:012d}/state.bin")

            def load(s=step, cold=True, payload=payload) -> float:
                if self.local and cold:
                    drop_cache(payload)
                t0 = time.perf_counter()
                state = from_bytes(self.store.read(s).files["state.bin"])
                seconds = time.perf_counter() - t0
                # Freed after the clock stops, as the raw read's buffer is: unmapping the touched
                # pages is not part of a load (docs/performance.md), and a resume keeps them.
                del state
                return seconds

            pairs["load"].append(paired(load, lambda p=payload: self._raw_read(p), ours_first))
            if self.local:
                pairs["load_warm"].append(
                    paired(
                        lambda: load(cold=False),
                        lambda p=payload: self._raw_read(p, cold=False),
                        ours_first,
                    )
                )
            self.store.delete(step)
        out: dict[str, Any] = {}
        for name, ratio_of in (
            ("blocked", lambda ours, floor: ours / floor),  # x the copy: lower is better
            ("persist", lambda ours, floor: floor / ours),  # x raw write speed: higher is better
            ("load", lambda ours, floor: floor / ours),  # x raw read speed
            ("load_warm", lambda ours, floor: floor / ours),
        ):
            if not pairs[name]:
                continue
            ours, floors = zip(*pairs[name], strict=True)
            ratios = [ratio_of(o, f) for o, f in pairs[name]]
            out[name] = {
                "s": statistics.median(ours),
                "floor_s": statistics.median(floors),
                "ratio": statistics.median(ratios),
                "spread": (max(ratios) - min(ratios)) / statistics.median(ratios),
                "ratios": [round(r, 3) for r in ratios],
            }
        return out

    def _warm_copy(self) -> Callable[[], float]:
        """The floor of a snapshot: every tensor copied into warm, preallocated host buffers
        (pinned, from a GPU), and nothing else."""
        src = tensors_in(self.state)
        on_gpu = self.device.type == "cuda"
        dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu) for t in src]
        for d in dst:
            d.zero_()  # warm: touched before timing

        def copy() -> float:
            t0 = time.perf_counter()
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=on_gpu)
            if on_gpu:
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        return copy

    def step_inflation(self, step_time: float = 0.02, steps: int = 40) -> float:
        """Median toy step time while persists run in the background, over the same without."""
        from elastictrain.toy import ToyModel

        model = ToyModel(hidden=256, layers=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(64, 10), torch.randn(64, 5)

        def one_step() -> float:
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            time.sleep(step_time)
            return time.perf_counter() - t0

        quiet = statistics.median(one_step() for _ in range(steps))
        snap = staging.Staging().snapshot(self.state)
        busy, done = [], threading.Event()

        def persist_loop() -> None:
            for i in range(self.repeats):
                self.store.commit(1000 + i, {"state.bin": snap.data}, {})
                self.store.delete(1000 + i)
            done.set()

        threading.Thread(target=persist_loop, daemon=True).start()
        while not done.is_set():
            busy.append(one_step())
        return statistics.median(busy) / quiet - 1 if busy else 0.0

    def run(self) -> dict[str, Any]:
        gb = self.nbytes / 1e9
        torch_save = self.torch_save_s()
        dcp_save, dcp_blocked = self.dcp()
        pairs = self.elastictrain()
        result = {
            "bytes": self.nbytes,
            "device": str(self.device),
            "repeats": self.repeats,
            "location": storage.redact_url(self.root),
            "copy_s": pairs["blocked"]["floor_s"],
            "raw_write_gbps": gb / pairs["persist"]["floor_s"],
            "raw_read_gbps": gb / pairs["load"]["floor_s"],
            "torch_save_s": torch_save,
            "dcp_save_s": dcp_save,
            "dcp_async_blocked_s": dcp_blocked,
            "elastictrain_blocked_s": pairs["blocked"]["s"],
            "elastictrain_persist_s": pairs["persist"]["s"],
            "blocked_over_copy": pairs["blocked"]["ratio"],
            "persist_over_raw_write": pairs["persist"]["ratio"],
            "load_s": pairs["load"]["s"],
            "load_over_raw_read": pairs["load"]["ratio"],
            "persist_gbps": gb / pairs["persist"]["s"],
            "load_gbps": gb / pairs["load"]["s"],
            "pairs": pairs,
            "noisy": sorted(k for k, v in pairs.items() if v["spread"] > NOISY_SPREAD),
            "step_inflation": self.step_inflation(),
        }
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.fs_root, recursive=True)
        return result


NOISY_SPREAD = 0.25
"""A ratio whose pairs span more than this fraction of their median is not to be trusted."""


def table(r: dict[str, Any]) -> str:
    copy, gb, pairs = r["copy_s"], r["bytes"] / 1e9, r["pairs"]

    def row(name: str, seconds: float | None, ratio: str) -> str:
        shown = "n/a" if seconds is None else f"{seconds:8.3f} s"
        return f"| {name:<44} | {shown:>10} | {ratio:>30} |"

    def vs_copy(s: float | None) -> str:
        return "" if s is None else f"{s / copy:.1f}x the copy"

    def paired(name: str, unit: str) -> str:
        p = pairs[name]
        flag = " (!)" if p["spread"] > NOISY_SPREAD else ""
        return f"{p['ratio']:.2f}x {unit} +-{50 * p['spread']:.0f}%{flag}"

    lines = [
        f"state: {gb:.2f} GB at {r['location']}; each ratio is the median of {r['repeats']} "
        "back-to-back pairs (+- half their range)",
        f"| {'what':<44} | {'time':>10} | {'ratio':>30} |",
        f"|{'-' * 46}|{'-' * 12}|{'-' * 32}|",
        row("copy into warm buffers (the floor)", copy, "1.0x"),
        row(f"raw write + fsync ({r['raw_write_gbps']:.2f} GB/s)", pairs["persist"]["floor_s"], ""),
        row(f"raw read ({r['raw_read_gbps']:.2f} GB/s)", pairs["load"]["floor_s"], ""),
        row("torch.save + fsync, blocking", r["torch_save_s"], vs_copy(r["torch_save_s"])),
        row("DCP save, blocking", r["dcp_save_s"], vs_copy(r["dcp_save_s"])),
        row(
            "DCP async_save: loop blocked",
            r["dcp_async_blocked_s"],
            vs_copy(r["dcp_async_blocked_s"]),
        ),
        row(
            "elastictrain: loop blocked", r["elastictrain_blocked_s"], paired("blocked", "the copy")
        ),
        row(
            f"elastictrain: background persist ({r['persist_gbps']:.2f} GB/s)",
            r["elastictrain_persist_s"],
            paired("persist", "raw write"),
        ),
        row(
            f"elastictrain: load + verify ({r['load_gbps']:.2f} GB/s)",
            r["load_s"],
            paired("load", "raw read"),
        ),
    ]
    if "load_warm" in pairs:
        lines.append(
            row(
                "  the same two reads from the page cache",
                pairs["load_warm"]["s"],
                paired("load_warm", "raw read"),
            )
        )
    lines.append(f"step-time inflation while persisting: {r['step_inflation'] * 100:+.1f}%")
    if r["noisy"]:
        lines.append(
            f"(!) {', '.join(r['noisy'])}: the pairs spread over more than "
            f"{100 * NOISY_SPREAD:.0f}% of their median; this machine was too noisy to trust "
            "that ratio. Run again with more --repeats on a quiet machine."
        )
    return "\n".join(lines)


def main(
    checkpoint_dir: str,
    options: dict[str, Any],
    size: int,
    repeats: int,
    device: str,
    as_json: bool,
) -> int:
    # The runner's preflight, so a missing bucket or a dead endpoint is named in seconds.
    storage.open_store(checkpoint_dir, storage_options=options).probe()
    torch.set_num_threads(1)  # like a worker under torchrun (OMP_NUM_THREADS=1): fair to everyone
    result = Bench(checkpoint_dir, options, size, repeats, device).run()
    print(json.dumps(result, indent=1) if as_json else table(result))
    return 0
