"""Library mode: your own training loop, elastictrain's checkpoints (elastictrain.CheckpointManager).

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 \
        examples/custom_loop.py --checkpoint-dir ./checkpoints-custom --steps 2000

Kill a worker (kill -9) while it runs: torchrun restarts both, resume() loads the newest checkpoint
and the loop carries on, ending bit for bit where an uninterrupted run ends. With
--replace-in-place (CPU/gloo) nothing restarts: the dead rank's pre-imported spare takes its
place, the other rank keeps its process and its state, and the step in flight is redone
(CheckpointManager.run; README, "Library mode"). Send torchrun SIGTERM
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
    p.add_argument("--replace-in-place", action="store_true", help="survivors keep training")
    p.add_argument(
        "--run-loop",
        action="store_true",
        help="train with CheckpointManager.run (what --replace-in-place uses), not the for loop",
    )
    p.add_argument(
        "--compare-replicas-every", type=int, default=100, help="steps between digest checks"
    )
    p.add_argument("--replace-wait", type=float, default=0.5, help="seconds for a replacement")
    p.add_argument(
        "--max-replacements", type=int, default=3, help="deaths a rank's spares take, then torchrun"
    )
    args = p.parse_args()

    # Restart-safe init_process_group; a no-op without torchrun. In place, the process torchrun
    # started supervises this script's training process and a spare from here on.
    elastictrain.init_distributed(
        replace_in_place=args.replace_in_place,
        replace_wait=args.replace_wait,
        max_replacements=args.max_replacements,
    )
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
        if not distributed or dist.get_rank() == 0:
            world = dist.get_world_size() if distributed else 1
            print(f"starting at step {start} (world size {world}); saved extra: {ckpt.extra}")

        def train_step(step: int, net: nn.Module) -> dict:
            """Forward and backward; the optimizer steps after it (in ckpt.run, or below)."""
            # Read every step: a lost node changes them under CheckpointManager.run.
            rank = dist.get_rank() if distributed else 0
            world = dist.get_world_size() if distributed else 1
            # The batch is a function of the step alone: a resumed run sees exactly the same data.
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(step))
            x, y = data[order[: args.batch_size][rank::world]]
            loss = mse(net(x), y)
            loss.backward()
            time.sleep(args.step_time)
            return {"loss": loss.item()}

        wrap = DDP if distributed else (lambda m: m)
        if args.replace_in_place or args.run_loop:  # in place, a death is recovered in run()
            extra = ckpt.run(
                train_step,
                model,
                optimizer,
                scheduler,
                start=start,
                stop=args.steps,
                wrap=wrap,
                compare_replicas_every=args.compare_replicas_every,
            )
        else:
            net, extra = wrap(model), ckpt.extra
            for step in range(start, args.steps):
                optimizer.zero_grad(set_to_none=True)
                extra = train_step(step, net)
                optimizer.step()
                scheduler.step()
                ckpt.step(step + 1, model, optimizer, scheduler, extra=extra)
        extra = extra or {"loss": float("nan")}  # when no step was left to run
        ckpt.save(args.steps, model, optimizer, scheduler, extra, final=True)
    if not distributed or dist.get_rank() == 0:
        print(f"finished {args.steps} steps, loss {extra['loss']:.5f}")


if __name__ == "__main__":
    main()
