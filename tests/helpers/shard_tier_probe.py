"""The fast tier for sharded state, through its losses: run under torchrun with 4 processes.

    python -m torch.distributed.run --standalone --nproc_per_node=4 -m tests.helpers.shard_tier_probe ROOT

Ranks 0-1 and 2-3 play two nodes of 2 ranks (each pair its own tier folder, ROOT/node0 and
ROOT/node1). An FSDP2 model in library mode takes fast copies every 5 steps and durable ones every
13; then, each time with new processes' worth of state (a fresh model and manager):

1. node 1's folder is wiped (a replaced node): resume from step 10, node 1's shards sent by node 0;
2. node 1 wiped again, and a byte of rank 2's newest copy on node 0 flipped: that copy is
   reported and skipped, and resume takes step 15 (the newest step the fast tier holds whole);
3. node 1 wiped and node 0's buddy copies too (both copies of ranks 2-3 lost): the durable tier's
   step 13;
4. HSDP (a replica on each node), node 1 wiped: its ranks' shards come from their twins' copies
   on node 0, which hold every replica's chunks; only rank 0 sent a buddy copy (the index).

Each resume is checked against the full state recorded at that step (torch.equal). Rank 0 prints
one ``PROBE`` JSON line; exit 0 when every check passed.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys

import torch.distributed as dist

from elastictrain import CheckpointManager, init_distributed
from elastictrain.observe.events import Event, read_events
from tests.helpers.fsdp_probe import build, equal, full_state, train_step


def manager(root: str, rank: int) -> CheckpointManager:
    return CheckpointManager(
        os.path.join(root, "durable"),
        checkpoint_every_steps=13,
        local_checkpoint_dir=os.path.join(root, f"node{rank // 2}"),
        local_every_steps=5,
        event_log=os.path.join(root, "events.jsonl"),
        keep_last=5,
    )


def wipe(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def flip_newest_shard(folder: str) -> str:
    step_dir = os.path.join(
        folder, sorted(d for d in os.listdir(folder) if d.startswith("step-"))[-1]
    )
    (shard,) = [f for f in os.listdir(step_dir) if f.startswith("shard-")]
    path = os.path.join(step_dir, shard)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def main() -> int:
    root = sys.argv[1]
    rank = int(os.environ["RANK"])
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "2", str(rank % 2)
    init_distributed()
    seen: dict = {k: [] for k in ("resumed", "differs", "tiers", "peer_bytes", "durable_bytes")}
    seen["served_by"] = []
    refs: dict[int, dict] = {}

    def run(start_expected: int | None, until: int, replicas: int = 1, where: str = root) -> None:
        model, optimizer = build(replicas)
        m = manager(where, rank)
        start = m.resume(model, optimizer)
        seen["resumed"].append(start)
        if start:
            now = full_state(model, optimizer)  # collective: every rank
            if rank == 0:
                seen["differs"] += equal(now, refs[start], f"at {start}")
        for step in range(start, until):
            train_step(model, optimizer, step)
            m.step(step + 1, model, optimizer)
            if (step + 1) % 5 == 0 or (step + 1) % 13 == 0:
                state = full_state(model, optimizer)
                if rank == 0:  # a copy: the optimizer's step counters are the live tensors
                    refs[step + 1] = copy.deepcopy(state)
        m.close()
        dist.barrier()

    def last_resume(where: str = root) -> dict:
        return [e for e in read_events(os.path.join(where, "events.jsonl"))
                if e["event"] == Event.RESUME][-1]  # fmt: skip

    def note_resume(where: str = root) -> None:
        if rank == 0:
            r = last_resume(where)
            seen["tiers"].append(r.get("tier"))
            seen["peer_bytes"].append(r.get("peer_bytes"))
            seen["durable_bytes"].append(r.get("remote_bytes"))
            seen["served_by"].append(r.get("served_by"))

    run(None, 12)  # fast copies at 5 and 10 (and their buddies'), none durable yet
    # 1. A replaced node: its folder is empty; its ranks' shards come from node 0's buddy copies.
    if rank == 2:
        wipe(os.path.join(root, "node1"))
    dist.barrier()
    run(10, 21)  # durable at 13; fast at 15 and 20
    note_resume()
    # 2. Node 1 lost again, and rank 2's newest copy on node 0 (its buddy's) has a flipped byte.
    if rank == 2:
        wipe(os.path.join(root, "node1"))
        seen_path = flip_newest_shard(os.path.join(root, "node0", "shards", "peer-r00002"))
        print(f"flipped a byte of {seen_path}", flush=True)
    dist.barrier()
    run(15, 16)
    note_resume()
    # 3. Both copies of ranks 2 and 3 lost: node 1, and the buddy copies on node 0.
    if rank == 2:
        wipe(os.path.join(root, "node1"))
        for name in ("peer-r00002", "peer-r00003"):
            wipe(os.path.join(root, "node0", "shards", name))
    dist.barrier()
    run(13, 13)
    note_resume()
    if rank == 0:
        corrupt = [e for e in read_events(os.path.join(root, "events.jsonl"))
                   if e["event"] == Event.CORRUPT]  # fmt: skip
        seen["corrupt"] = [(e["step"], e["tier"], "peer copy" in e["error"]) for e in corrupt]
    # 4. HSDP with a replica on each node (mesh rows: 0-1 and 2-3): each node's copies hold every
    # replica's chunks and stand in for the other's, so only rank 0 (the index) sends a buddy
    # copy. Node 1 replaced: its shards come from its twins' copies on node 0.
    hsdp = os.path.join(root, "hsdp")
    run(None, 12, replicas=2, where=hsdp)
    if rank == 0:
        for node in ("node0", "node1"):
            seen[f"hsdp_{node}"] = sorted(os.listdir(os.path.join(hsdp, node, "shards")))
    dist.barrier()
    if rank == 2:
        wipe(os.path.join(hsdp, "node1"))
    dist.barrier()
    run(10, 11, replicas=2, where=hsdp)
    note_resume(hsdp)
    if rank == 0:
        print("PROBE " + json.dumps(seen), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    dist.destroy_process_group()
    from elastictrain.runtime.signals import exit_without_teardown

    exit_without_teardown(code)
