"""The GPU tier's NCCL in-place cases (``tests/gpu/test_cuda.py``), run by torchrun on one GPU.
Prints one JSON line (rank 0) with what it saw.

    torchrun --standalone --nproc_per_node=1 -m tests.helpers.nccl_in_place_probe abort
        One rank's NCCL group: a collective queued behind a long kernel, the epoch's end
        announced, the watch aborts the communicators (``epoch_end``); the collective's error
        reads as a peer's loss, the process lives (TORCH_NCCL_ASYNC_ERROR_HANDLING=0), and the
        next epoch's NCCL group is built in the same process and computes right.
    torchrun --standalone --nproc_per_node=2 -m tests.helpers.nccl_in_place_probe live
        Two ranks sharing cuda:0 over gloo (NCCL refuses two ranks on one device): rank 0, a
        survivor, holds a CUDA model and AdamW state three steps in; rank 1, a replacement, gets
        it live (``checkpoint.resume.live.fetch``), mapped to its device, bitwise.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.checkpoint.resume import live as live_resume
from elastictrain.checkpoint.state import train_state as tstate
from elastictrain.cluster.env import read_env
from elastictrain.cluster.groups import init_process_groups, shutdown
from elastictrain.cluster.liveness import Liveness
from elastictrain.inplace import epoch_end, members


def _groups(env, device, in_place: bool):
    return init_process_groups(
        env,
        device,
        init_timeout=60,
        collective_timeout=60,
        checkpoint_timeout=60,
        liveness=Liveness(env.rank, env.world_size, interval_s=1.0, silent_s=0),
        store_up=in_place,
    )


def abort() -> dict:
    env, device = read_env(), torch.device("cuda", 0)
    torch.cuda.set_device(device)
    epoch_end.prepare_nccl()
    groups = _groups(env, device, in_place=False)
    end = epoch_end.EpochEnd(
        groups.attempt.nonce, members.store_port(env), groups.connections, member=env.rank
    )
    end.watch(groups.store)
    t = torch.full((1024,), 3.0, device=device)
    dist.all_reduce(t)
    first_ok = bool((t == 3.0).all())
    torch.cuda._sleep(int(5e9))  # seconds of GPU time ahead of the collective on the stream
    work = dist.all_reduce(t, async_op=True)
    t0 = time.monotonic()
    # A member back from the epoch.
    epoch_end.announce(groups.store, groups.attempt.nonce, range(env.world_size))
    while not end.failed and time.monotonic() - t0 < 30:
        time.sleep(0.001)
    abort_s = time.monotonic() - t0
    try:
        work.wait()
        dist.all_reduce(t)  # on the aborted group: must raise
        raised, peer_loss = None, False
    except Exception as e:
        raised, peer_loss = f"{type(e).__name__}: {str(e)[:200]}", members.is_peer_loss(e, end)
    torch.cuda.synchronize(device)
    end.close()
    shutdown()
    groups = _groups(env, device, in_place=True)  # the next epoch, in this process
    u = torch.full((1024,), 5.0, device=device)
    dist.all_reduce(u)
    rebuilt_ok = bool((u == 5.0).all())
    shutdown()
    return {
        "first_ok": first_ok,
        "abort_s": round(abort_s, 4),
        "raised": raised,
        "peer_loss": peer_loss,
        "rebuilt_ok": rebuilt_ok,
    }


def _digest(state: tstate.TrainState) -> str:
    h = hashlib.sha256()
    for k, v in sorted(state.model.state_dict().items()):
        h.update(k.encode() + v.detach().cpu().numpy().tobytes())
    for s in state.optimizer.state_dict()["state"].values():
        for k in sorted(s):
            h.update(k.encode() + torch.as_tensor(s[k]).detach().cpu().numpy().tobytes())
    return h.hexdigest()


def live() -> dict:
    env = read_env()
    # cuda:0 on the GPU tier; the CPU where there is none, so the probe itself runs anywhere.
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("gloo")
    torch.manual_seed(env.rank)  # the replacement starts from other values
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    state = tstate.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if env.rank == 0:
        for _ in range(3):
            state.optimizer.zero_grad()
            model(torch.randn(16, 64, device=device)).square().mean().backward()
            state.optimizer.step()
    else:  # a replacement's optimizer has state only once it has stepped: give it some
        model(torch.randn(16, 64, device=device)).square().mean().backward()
        state.optimizer.step()
    before = [None, None]
    dist.all_gather_object(before, _digest(state))
    held = tstate.capture(state, step=3) if env.rank == 0 else None
    source = live_resume.Live(held, 3 if env.rank == 0 else -1, None, 0, None)
    restored = live_resume.fetch(source, state, device, dist.group.WORLD, env.rank, 2)
    digests = [None, None]
    dist.all_gather_object(digests, _digest(state))
    on_device = all(p.device == device for p in model.parameters())
    dist.destroy_process_group()
    return {
        "differed_before": before[0] != before[1],
        "bitwise_equal": digests[0] == digests[1],
        "on_device": on_device,
        "device": str(device),
        "bytes": restored.nbytes,
        "tier": restored.origin.tier.value,
        "rank": env.rank,
    }


if __name__ == "__main__":
    out = {"abort": abort, "live": live}[sys.argv[1]]()
    if read_env().rank == 0 or sys.argv[1] == "live":
        print("PROBE " + json.dumps(out), flush=True)
