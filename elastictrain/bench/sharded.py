"""``python -m elastictrain bench sharded``: sharded (FSDP2) checkpoints against their floors and
against DCP, side by side on the same sharded state.

Two torchrun jobs on this machine (gloo, CPU): 2 ranks save, then 3 ranks resume the same
checkpoint. Each rank holds an FSDP2 model of Linear layers plus its AdamW moments; ``--size`` is the
whole state. Figures, each the median of ``--repeats`` and the worst rank's:

- blocked ÷ copy: what a scheduled checkpoint holds the training thread, over a plain copy of the
  rank's local shards into buffers that are already warm (the floor of any snapshot);
- save throughput ÷ ``dcp.save``: a foreground checkpoint (snapshot, write + hash, every rank's
  report, the commit) against ``dcp.save`` of the same state dict; and ``dcp.async_save``'s blocked
  time beside ours;
- bytes read ÷ new shard: what each rank at world size 3 read to resume a 2-rank checkpoint (index
  and common file included), over its new local shards;
- peak extra memory ÷ shard: the most the process's resident memory grew during its first
  checkpoint (the staging buffer is allocated then), over the rank's local shards.

``--replicas R`` adds a third job: the same state as HSDP over R replicas of the 2 shards (2R
ranks), with the bytes of one checkpoint against the FSDP one's (target <= 1.05: each shard is
written once) and against ``dcp.save``'s of the same HSDP state, each replica's share of the bytes
(about 1/R), and the foreground save time beside FSDP's and ``dcp.save``'s; then a fourth job
resumes it as HSDP through the runner's durable path, where the replicas share the reads: the
shard bytes all ranks read from storage together, over the state (about 1.0; R if each replica
read alone).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.bench.child import child_env, torchrun

WIDTH = 2048  # 16 MB weights: tensors the size of a small transformer's


def _build(size: int, replicas: int = 1) -> Any:
    from elastictrain.checkpoint.state.train_state import TrainState
    from elastictrain.mesh import MeshShape
    from elastictrain.train import parallel

    torch.manual_seed(0)
    layers = max(1, size // 12 // (WIDTH * WIDTH))  # fp32 weights + AdamW's two moments
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    shape = MeshShape(dp_replicate=replicas, dp_shard=dist.get_world_size() // replicas)
    parallel.shard(model, None, torch.device("cpu"), shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    return TrainState(model, optimizer)


def _local_bytes(state: Any) -> int:
    from elastictrain.checkpoint.sharded import format as sharded

    tensors = sharded.local_shards(sharded.split(sharded.capture(state, step=0))[0]).tensors
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _checkpointer(url: str) -> Any:
    from elastictrain.checkpoint.checkpointer import Checkpointer
    from elastictrain.config import CheckpointConfig
    from elastictrain.observe.events import EventLog

    config = CheckpointConfig(
        checkpoint_dir=url,
        storage_retry_deadline=60.0,
        keep_last=1000,
        local_checkpoint=False,
    )
    return Checkpointer(
        config,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=dist.get_rank(),
        generation=1,
        group=dist.group.WORLD,
        events=EventLog(None, enabled=False),
    )


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """The highest resident set size seen while the block runs, sampled every millisecond."""

    def __enter__(self) -> _PeakRss:
        self.start, self.peak, self._stop = _rss(), _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def _written(url: str, step: int) -> dict[str, Any]:
    """Bytes of our checkpoint of ``step`` (every file), by shard file, and of ``dcp.save``'s."""
    from storage.manifest import parse_step_dir

    step_dir = next(os.path.join(url, n) for n in os.listdir(url) if parse_step_dir(n) == step)
    shards = sorted(n for n in os.listdir(step_dir) if n.startswith("shard-"))
    return {
        "checkpoint_bytes": _dir_bytes(step_dir),
        "shard_file_bytes": [os.path.getsize(os.path.join(step_dir, n)) for n in shards],
        "dcp_bytes": _dir_bytes(os.path.join(url, "dcp0")),
    }


def save_worker(url: str, size: int, repeats: int, out: str, replicas: int = 1) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elastictrain.checkpoint.api import Reason
    from elastictrain.checkpoint.sharded import format as sharded

    state, ckpt = _build(size, replicas), _checkpointer(url)
    shard = _local_bytes(state)
    local = sharded.local_shards(sharded.split(sharded.capture(state, step=0))[0]).tensors
    warm = {k: torch.empty_like(t) for k, t in local.items()}
    for k, t in local.items():
        warm[k].copy_(t)

    def copy() -> None:
        for k, t in local.items():
            warm[k].copy_(t)

    copies = [_timed(copy) for _ in range(repeats)]
    with _PeakRss() as mem:  # the first checkpoint allocates and touches the staging buffer
        ckpt.save(1, state, Reason.STEPS)
        ckpt.finish()
    blocked, ours, dcp_s, dcp_blocked = [], [], [], []
    for i in range(repeats):
        blocked.append(_timed(lambda i=i: ckpt.save(10 + i, state, Reason.STEPS)))
        ckpt.finish()
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        sd = {"model": model_sd, "optim": optim_sd}

        def theirs(i=i, sd=sd) -> None:
            dcp.save(sd, checkpoint_id=os.path.join(url, f"dcp{i}"))

        # Alternated, so neither always meets the disk the other just filled.
        for which in ("ours", "dcp") if i % 2 == 0 else ("dcp", "ours"):
            if which == "ours":
                ours.append(_timed(lambda i=i: ckpt.save(100 + i, state, Reason.FINAL)))
            else:
                dcp_s.append(_timed(theirs))
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(sd, checkpoint_id=os.path.join(url, f"dcp-async{i}"))
        dcp_blocked.append(time.perf_counter() - t0)
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    mine = {
        "shard_bytes": shard,
        "copy_s": statistics.median(copies),
        "blocked_s": statistics.median(blocked),
        "save_s": statistics.median(ours),
        "dcp_save_s": statistics.median(dcp_s),
        "dcp_async_blocked_s": statistics.median(dcp_blocked),
        "peak_extra_bytes": mem.peak - mem.start,
    }
    dist.barrier()
    if dist.get_rank() == 0:
        mine.update(_written(url, 100))  # the first foreground save's step
    _gather(mine, out)


def resume_worker(url: str, size: int, out: str, replicas: int = 1) -> None:
    """Resume the newest checkpoint at this world size; under HSDP (``replicas`` > 1) through the
    runner's durable path, where the replicas share the reads."""
    import storage
    from elastictrain.checkpoint.resume.durable_shards import load_step
    from elastictrain.checkpoint.sharded import format as sharded
    from elastictrain.checkpoint.sharded import load as shard_load

    state = _build(size, replicas)
    store = storage.open_store(url)
    manifest = max(
        (m for m in store.ranked_manifests() if sharded.is_sharded_checkpoint(m.metadata)),
        key=lambda m: m.step,
    )
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    if replicas > 1:
        _, ranged = load_step(
            state, store, manifest, cpu, group=dist.group.WORLD, rank=dist.get_rank()
        )
    else:
        _, ranged = shard_load.load_into(state, store, manifest, cpu)
    seconds = time.perf_counter() - t0
    index = manifest.metadata["index_file"]
    small = manifest.files[index].size + sum(
        e.size for n, e in manifest.files.items() if n.startswith("common-")
    )
    mine = {"read_bytes": ranged + small, "shard_read_bytes": ranged}
    _gather({**mine, "new_shard_bytes": _local_bytes(state), "load_s": seconds}, out)


def _gather(mine: dict[str, Any], out: str) -> None:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)


def _torchrun(nproc: int, args: list[str]) -> None:
    cmd = torchrun("-m", "elastictrain.bench.sharded", *args, nproc=nproc)
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"sharded bench worker failed:\n{done.stderr[-3000:]}")


def run(size: int, repeats: int, where: str, replicas: int = 1) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="elastictrain-sharded-bench-", dir=where)
    try:
        url = os.path.join(scratch, "ckpt")
        saved, resumed = os.path.join(scratch, "save.json"), os.path.join(scratch, "resume.json")
        _torchrun(2, ["save", url, str(size), str(repeats), saved])
        _torchrun(3, ["resume", url, str(size), "1", resumed])
        with open(saved) as f:
            ranks = json.load(f)
        with open(resumed) as f:
            readers = json.load(f)
        hsdp = None
        if replicas > 1:
            url, saved = os.path.join(scratch, "hsdp"), os.path.join(scratch, "hsdp.json")
            _torchrun(2 * replicas, ["save", url, str(size), str(repeats), saved, str(replicas)])
            _torchrun(2 * replicas, ["resume", url, str(size), "1", resumed, str(replicas)])
            with open(saved) as f, open(resumed) as g:
                hsdp = _hsdp(json.load(f), ranks, replicas, json.load(g))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def worst(key: str) -> float:
        return max(r[key] for r in ranks)

    return {
        "state_bytes": sum(r["shard_bytes"] for r in ranks),
        "ranks": ranks,
        "resume_at_3": readers,
        "blocked_over_copy": worst("blocked_s") / worst("copy_s"),
        "save_throughput_over_dcp": worst("dcp_save_s") / worst("save_s"),
        "dcp_async_blocked_s": worst("dcp_async_blocked_s"),
        "blocked_s": worst("blocked_s"),
        "read_over_new_shard": max(r["read_bytes"] / r["new_shard_bytes"] for r in readers),
        "peak_extra_over_shard": max(r["peak_extra_bytes"] / r["shard_bytes"] for r in ranks),
        "hsdp": hsdp,
    }


def _hsdp(
    ranks: list[dict[str, Any]], fsdp: list[dict[str, Any]], replicas: int, readers: list[dict]
) -> dict:
    """HSDP R x 2 against FSDP at 2 ranks (``fsdp``) and against dcp.save of the same state; and
    its resume as HSDP (``readers``): the shard bytes every rank read from storage together."""
    files = ranks[0]["shard_file_bytes"]  # rank order: replica r holds ranks 2r and 2r + 1
    by_replica = [files[2 * r] + files[2 * r + 1] for r in range(replicas)]
    save_s, dcp_s = max(r["save_s"] for r in ranks), max(r["dcp_save_s"] for r in ranks)
    return {
        "replicas": replicas,
        "checkpoint_bytes": ranks[0]["checkpoint_bytes"],
        "bytes_over_fsdp": ranks[0]["checkpoint_bytes"] / fsdp[0]["checkpoint_bytes"],
        "bytes_over_dcp": ranks[0]["checkpoint_bytes"] / ranks[0]["dcp_bytes"],
        "replica_shares": [b / sum(by_replica) for b in by_replica],
        "save_s": save_s,
        "fsdp_save_s": max(r["save_s"] for r in fsdp),
        "dcp_save_s": dcp_s,
        "resume_read_over_state": sum(r["shard_read_bytes"] for r in readers)
        / sum(r["shard_bytes"] for r in fsdp),
        "resume_load_s": max(r["load_s"] for r in readers),
    }


def table(r: dict[str, Any]) -> str:
    mb = r["state_bytes"] / 1e6
    rows = [
        f"sharded state {mb:.0f} MB over 2 ranks (gloo, CPU); worst rank of each, median of repeats",
        f"  training blocked per checkpoint   {r['blocked_s'] * 1e3:8.1f} ms   "
        f"{r['blocked_over_copy']:.2f}x the copy of the local shard into warm buffers (target <= 1.2)",
        f"  dcp.async_save blocked            {r['dcp_async_blocked_s'] * 1e3:8.1f} ms",
        f"  save throughput with hashing      {r['save_throughput_over_dcp']:.2f}x dcp.save's "
        "(target >= 1.0)",
        f"  bytes read resuming 2 -> 3 ranks  {r['read_over_new_shard']:.3f}x the new shard "
        "(target <= 1.1)",
        f"  peak extra memory in a checkpoint {r['peak_extra_over_shard']:.2f}x the shard "
        "(target <= 1.2)",
    ]
    h = r.get("hsdp")
    if h:
        shares = " ".join(f"{s:.0%}" for s in h["replica_shares"])
        rows += [
            f"HSDP {h['replicas']} replicas x 2 shards ({2 * h['replicas']} ranks), same state",
            f"  bytes per checkpoint              {h['bytes_over_fsdp']:.3f}x FSDP at 2 ranks "
            f"(target <= 1.05), {h['bytes_over_dcp']:.3f}x dcp.save's",
            f"  each replica's share of the bytes {shares} (about 1/{h['replicas']} each)",
            f"  foreground save                   {h['save_s'] * 1e3:8.1f} ms   "
            f"(FSDP at 2: {h['fsdp_save_s'] * 1e3:.1f} ms; dcp.save: {h['dcp_save_s'] * 1e3:.1f} ms)",
            f"  resumed as HSDP: shard bytes read {h['resume_read_over_state']:.3f}x the state, "
            f"all ranks together (each replica alone: {h['replicas']}x); "
            f"{h['resume_load_s'] * 1e3:.1f} ms",
        ]
    return "\n".join(rows)


def main(size: int, repeats: int, as_json: bool, where: str, replicas: int = 1) -> int:
    result = run(size, repeats, where, replicas)
    print(json.dumps(result, indent=1) if as_json else table(result))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mode, url, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
        if mode == "save":
            replicas = int(sys.argv[6]) if len(sys.argv) > 6 else 1
            save_worker(url, size, int(sys.argv[4]), sys.argv[5], replicas)
        else:
            replicas = int(sys.argv[6]) if len(sys.argv) > 6 else 1
            resume_worker(url, size, sys.argv[5], replicas)
    finally:
        dist.destroy_process_group()
    from elastictrain.runtime.signals import exit_without_teardown

    exit_without_teardown(0)  # torch's FSDP/gloo teardown aborted one of these workers once
