"""The digits CNN as a real job: bf16 autocast, gradient accumulation, clipping, dropout, an EMA of
the weights in ``Task.state``, random augmentation in loader workers, a training metric from
``loss_fn`` and an evaluation on the held-out split. Data ships with scikit-learn (no download).

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m elastictrain \\
        --task examples.digits.full_job:make_task --max-steps 400 --checkpoint-every-steps 50 \\
        --precision bf16 --grad-accum-steps 2 --clip-grad-norm 1.0 --num-workers 2 \\
        --eval-every-steps 100 --checkpoint-dir ./checkpoints-digits-full

Kill workers as you like: every piece above (the EMA, the augmentation, the dropout, the
micro-batches) resumes exactly. Options (--task-option KEY=VALUE): batch_size (64, global),
lr (0.003), ema (0.99 decay), step_time (0 s of simulated extra compute per micro-batch).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from elastictrain import Task, eval_shard
from elastictrain.task import option
from examples.digits.task import build_model, splits


class Shifted(Dataset):
    """Training images, each shifted by up to one pixel at random: an augmentation drawn in
    ``__getitem__`` (so in the loader workers), from the seed the runner gives every batch."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        dy, dx = random.randint(-1, 1), random.randint(-1, 1)
        return torch.roll(x, shifts=(dy, dx), dims=(1, 2)), y


class EMA:
    """An exponential moving average of the weights; ``state_dict``/``load_state_dict`` make it
    a ``Task.state`` entry, checkpointed and restored with the model."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay, self.model = decay, copy.deepcopy(model).eval()

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for mine, live in zip(self.model.parameters(), model.parameters(), strict=True):
            mine.lerp_(live.detach().to(mine.device), 1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "model": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.model.load_state_dict(state["model"])


def make_task(options: Mapping[str, str]) -> Task:
    train, test = splits()
    step_time = option(options, "step_time", 0.0, float)
    lr = option(options, "lr", 0.003, float)
    model = build_model(dropout=0.2)
    ema = EMA(model, option(options, "ema", 0.99, float))
    cross_entropy = nn.CrossEntropyLoss()

    def loss_fn(m: nn.Module, batch):
        x, y = batch
        time.sleep(step_time)
        logits = m(x)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        return cross_entropy(logits, y), {"train_acc": accuracy}

    def evaluate(m: nn.Module) -> dict:
        idx = list(eval_shard(len(test)))  # this rank's share of the test split
        x, y = test.tensors[0][idx], test.tensors[1][idx]
        ema.model.to(next(m.parameters()).device)

        def acc(net: nn.Module) -> float:
            return (net(x.to(next(net.parameters()).device)).argmax(1).cpu() == y).float().mean()

        return {"test_acc": acc(m), "ema_test_acc": acc(ema.model)}

    return Task(
        model=model,
        dataset=Shifted(train),
        batch_size=option(options, "batch_size", 64),
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=1e-4),
        make_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=400),
        loss_fn=loss_fn,
        state={"ema": ema},
        after_step=lambda done, m: ema.update(m),
        evaluate=evaluate,
    )
