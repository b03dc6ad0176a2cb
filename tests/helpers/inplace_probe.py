"""Manual measurement (issue 36's design, docs/faults.md): can the survivors of a SIGKILLed
training process keep their processes and state, take in a pre-imported spare as the dead rank,
and train on, bitwise, without torchrun seeing a failure? And how long does it take?

    torchrun --standalone --nproc_per_node=4 -m tests.helpers.inplace_probe [--kill-rank 1]

Each process torchrun starts is a *supervisor*: it imports no torch, starts a training process and
a spare (which imports torch, then waits), and stays alive, so torchrun never sees a worker exit.
The training processes train a small DDP model on a process group keyed by a membership epoch
(``PrefixStore("inplace/epoch-E/")`` on torchrun's own store, which lives in the agent, not in any
training process). At step ``--kill-at`` the supervisor of ``--kill-rank`` SIGKILLs its training
process. Then:

1. the survivors' next collective fails (the peer's connection resets); each drops the step in
   flight and its process group, and posts that it is ready for epoch E+1;
2. the dead rank's supervisor sees its child exit and tells the spare: "you are rank r, epoch E+1";
3. everyone builds the epoch E+1 group; the survivors agree on the newest completed step (one
   all-reduce, the spare reporting -1); the lowest survivor at that step broadcasts the state
   (model, optimizer and step: one ``torch.save`` blob, loaded ``weights_only``, checked by its
   SHA-256; the runner would send its flat format, which is never unpickled);
4. all redo the step in flight and train on.

Rank 0 prints one ``PROBE`` JSON line: kill -> the survivors' next completed step, the parts of
it, and whether the final weights equal an uninterrupted run's (computed in the same processes
first, from the same seed).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from datetime import timedelta

STEPS = 60


def _batch(step: int, rank: int, world: int):
    import torch

    dim = int(os.environ["PROBE_DIM"])
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(32 // world, dim, generator=g), torch.randn(32 // world, 1, generator=g)


def _build():
    import torch

    dim = int(os.environ["PROBE_DIM"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU(), torch.nn.Linear(dim, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _group(store, epoch: int, rank: int, world: int):
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    prefixed = dist.PrefixStore(f"inplace/{os.environ['PROBE_RUN']}/epoch-{epoch}/", store)
    dist.init_process_group(
        "gloo", store=prefixed, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )


def _state_blob(model, optimizer, step: int) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, buf
    )
    return buf.getvalue()


def _train(rank: int, world: int, model, optimizer, start: int, log: list, kill_at, ready) -> int:
    """Steps ``start`` to ``STEPS``; returns the first step not completed (a failure stops it).
    ``kill_at``: ask the supervisor (``ready``) to SIGKILL this process at that step."""
    import torch
    import torch.distributed as dist

    step = start
    while step < STEPS:
        if kill_at is not None and step == kill_at and ready is not None:
            ready.send(("kill-me", step))  # the supervisor SIGKILLs us here, mid-run
            time.sleep(30)
        x, y = _batch(step, rank, world)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            for p in model.parameters():  # DDP's all-reduce, by hand: the failure point
                dist.all_reduce(p.grad)
                p.grad /= world
        except RuntimeError:
            return step  # the step in flight is dropped: its optimizer step never ran
        optimizer.step()
        step += 1
        log.append((time.time(), step))
    return step


def trainer(rank: int, world: int, conn, role: str) -> None:
    """A training process (``role`` "train") or a spare (``role`` "spare")."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    model, optimizer = _build()
    if role == "spare":
        conn.send(("spare-ready", 0))
        _, epoch = conn.recv()  # blocks until this spare is needed
        t_go = time.time()
    else:
        epoch = 0
    log: list = []
    kill_at = int(os.environ.get("PROBE_KILL_AT", "-1"))
    kill_rank = int(os.environ.get("PROBE_KILL_RANK", "-1"))
    doomed = role == "train" and rank == kill_rank
    timings: dict = {}
    step = 0
    if role == "train":
        _group(store, epoch, rank, world)
        step = _train(rank, world, model, optimizer, 0, log, kill_at if doomed else None, conn)
        if step >= STEPS:
            conn.send(("done", _final(model, log, timings)))
            return
        t_fail = time.time()
        epoch += 1
        timings["failed_at_step"] = step
    # Recovery (a survivor, or the spare taking the dead rank's place).
    t0 = time.time()
    _group(store, epoch, rank, world)
    timings["regroup_s"] = time.time() - t0
    completed = torch.tensor([step if role == "train" else -1])
    dist.all_reduce(completed, op=dist.ReduceOp.MAX)
    newest = int(completed.item())
    mine = torch.tensor([rank if role == "train" and step == newest else world])
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    source = int(mine.item())
    t1 = time.time()
    blob = _state_blob(model, optimizer, step) if rank == source else b""
    blob = _broadcast_bytes(blob, source)
    got = torch.load(io.BytesIO(blob), weights_only=True)
    model.load_state_dict(got["model"])
    optimizer.load_state_dict(got["optimizer"])
    timings["state_s"], timings["state_bytes"] = time.time() - t1, len(blob)
    step = _train(rank, world, model, optimizer, got["step"], log, None, None)
    timings["next_step_at"] = log[-(STEPS - got["step"])][0]  # the first step after recovery
    timings["redone_from"] = got["step"]
    if role == "train":
        timings["failure_seen_at"] = t_fail
    else:
        timings["spare_go_at"] = t_go
    conn.send(("done", _final(model, log, timings)))


def _broadcast_bytes(data: bytes, src: int) -> bytes:
    import torch
    import torch.distributed as dist

    n = torch.tensor([len(data)])
    dist.broadcast(n, src)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(int(n.item()), dtype=torch.uint8)
    )
    digest = (
        torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)
        if data
        else torch.empty(32, dtype=torch.uint8)
    )
    dist.broadcast(buf, src)
    dist.broadcast(digest, src)
    out = bytes(buf.numpy().tobytes())
    if hashlib.sha256(out).digest() != bytes(digest.numpy().tobytes()):
        raise RuntimeError("the state arrived changed")
    return out


def _final(model, log, timings) -> dict:
    weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    return {"weights": weights.hexdigest()[:16], **timings}


def supervisor() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=30)
    parser.add_argument("--dim", type=int, default=64, help="hidden width (state: 12 dim^2 bytes)")
    parser.add_argument("--out", default=None, help="folder for each rank's result")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["PROBE_DIM"] = str(args.dim)
    out = args.out or f"/tmp/inplace-probe-{os.environ['MASTER_PORT']}"
    os.makedirs(out, exist_ok=True)
    ctx = mp.get_context("spawn")
    results = {}
    for run, kill_at in (("reference", -1), ("killed", args.kill_at)):
        os.environ["PROBE_KILL_AT"], os.environ["PROBE_KILL_RANK"] = (
            str(kill_at),
            str(args.kill_rank),
        )
        os.environ["PROBE_RUN"] = run
        here, there = ctx.Pipe()
        spare_here, spare_there = ctx.Pipe()
        child = ctx.Process(target=trainer, args=(rank, world, there, "train"))
        spare = ctx.Process(target=trainer, args=(rank, world, spare_there, "spare"))
        child.start()
        spare.start()
        spare_here.recv()  # imported and built: ready to stand in
        kind, value = here.recv()
        if kind == "kill-me":
            t_kill = time.time()
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            spare_here.send(("go", 1))
            kind, value = spare_here.recv()
            value["killed_at"] = t_kill
        else:
            spare.kill()
        spare.join()
        child.join()
        results[run] = value
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if rank == 0:
        print("PROBE " + json.dumps(_summary(out, world)), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return 0


def _summary(out: str, world: int) -> dict:
    """Rank 0, once every rank's result is in: the figures of the killed run."""
    deadline, by_rank = time.time() + 60, {}
    while len(by_rank) < world and time.time() < deadline:
        for r in range(world):
            path = os.path.join(out, f"rank{r}.json")
            if r not in by_rank and os.path.exists(path):
                with open(path) as f:
                    by_rank[r] = json.load(f)
        time.sleep(0.1)
    killed = {r: v["killed"] for r, v in by_rank.items()}
    (victim,) = [r for r, k in killed.items() if "killed_at" in k]
    t_kill = killed[victim]["killed_at"]
    survivors = [k for r, k in killed.items() if r != victim]
    return {
        "kill_to_survivors_next_step_s": round(
            max(k["next_step_at"] for k in survivors) - t_kill, 4
        ),
        "kill_to_failure_seen_s": round(max(k["failure_seen_at"] for k in survivors) - t_kill, 4),
        "regroup_s": round(max(k["regroup_s"] for k in killed.values()), 4),
        "state_transfer_s": round(max(k["state_s"] for k in killed.values()), 4),
        "state_bytes": killed[victim]["state_bytes"],
        "steps_redone": sorted({k["redone_from"] for k in killed.values()}),
        "bitwise_equal_to_uninterrupted": all(
            v["killed"]["weights"] == v["reference"]["weights"] for v in by_rank.values()
        ),
    }


if __name__ == "__main__":
    sys.exit(supervisor())
