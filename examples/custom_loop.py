"""Library mode: your own training loop, elastictrain's checkpoints (elastictrain.CheckpointManager).

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 \
        examples/custom_loop.py --checkpoint-dir ./checkpoints-custom --steps 2000

Kill a worker (kill -9) while it runs: torchrun restarts both, resume() loads the newest checkpoint
and the loop carries on, ending bit for bit where an uninterrupted run ends. Send torchrun SIGTERM
(a preemption) or press Ctrl-C: every rank commits the current step and exits 75; run the command
again to continue. Also runs without torchrun, as one process: python examples/custom_loop.py.

elastictrain.init_distributed() replaces dist.init_process_group(): plain init can connect a
restarted group to the dead workers' addresses and fail ("Gloo connectFullMesh failed"); this one
uses the runner's restart-safe handshake.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import elastictrain
from elastictrain import CheckpointManager, Preempted
from elastictrain.toy import ToyModel, synthetic_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", default="./checkpoints-custom")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every-steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64, help="global")
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute, seconds")
    p.add_argument("--event-log", default=None)
    p.add_argument("--hang-timeout", type=float, default=600.0, help="seconds without a step")
    args = p.parse_args()

    elastictrain.init_distributed()  # restart-safe init_process_group; a no-op without torchrun
    distributed = dist.is_initialized()
    code = 0
    try:
        train(args, distributed)
    except Preempted as stop:  # every rank committed this step's checkpoint: relaunch to continue
        code = stop.code
    finally:
        if distributed:
            dist.destroy_process_group()
    sys.exit(code)


def train(args: argparse.Namespace, distributed: bool) -> None:
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(0)  # identical initial weights on every rank
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=200, gamma=0.5)
    data = synthetic_dataset(4096)
    mse = nn.MSELoss()

    with CheckpointManager(
        args.checkpoint_dir,
        checkpoint_every_steps=args.every_steps,
        keep_last=2,
        event_log=args.event_log,
        hang_timeout=args.hang_timeout,  # a stopped peer: stacks, exit 4, torchrun restarts
    ) as ckpt:
        start = ckpt.resume(model, optimizer, scheduler)  # before DDP: it broadcasts from rank 0
        if rank == 0:
            print(f"starting at step {start} (world size {world}); saved extra: {ckpt.extra}")
        net = DDP(model) if distributed else model
        loss = torch.tensor((ckpt.extra or {}).get("loss", float("nan")))  # if no step is left
        for step in range(start, args.steps):
            # The batch is a function of the step alone: a resumed run sees exactly the same data.
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(step))
            x, y = data[order[: args.batch_size][rank::world]]
            optimizer.zero_grad(set_to_none=True)
            loss = mse(net(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            time.sleep(args.step_time)
            ckpt.step(step + 1, model, optimizer, scheduler, extra={"loss": loss.item()})
        ckpt.save(args.steps, model, optimizer, scheduler, {"loss": loss.item()}, final=True)
    if rank == 0:
        print(f"finished {args.steps} steps, loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
