"""Language models whose output layer shares its weight with the input embedding (tied weights),
for the runner: a small GPT-2 from Hugging Face ``transformers``, built from a config (no
download), or a hand-written one.

Options: model (gpt2|handmade), dropout (0.1), split (1: a ``Task.shard`` that puts the two ends
of the tie in different FSDP groups, which the runner must refuse), step_time (0 s).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain import Task
from elastictrain.task import option

VOCAB, SEQ, WIDTH = 96, 16, 32


def gpt2_config(dropout: float = 0.1):
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2,
        n_embd=WIDTH,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )


def gpt2(dropout: float = 0.1) -> nn.Module:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config(dropout))
    assert model.lm_head.weight is model.transformer.wte.weight  # the library ties them
    return model


class HandmadeLM(nn.Module):
    """Embedding, two MLP blocks, and an output layer that reuses the embedding's weight."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(dropout)
            )
            for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def token_dataset(size: int = 512) -> TensorDataset:
    """Sequences that follow a fixed rule (next = 3 * prev + 1 mod VOCAB), so the loss falls."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    steps = torch.arange(SEQ).unsqueeze(0)
    return TensorDataset((start * (3**steps) + (3**steps - 1) // 2) % VOCAB)


def make_task(options: Mapping[str, str]) -> Task:
    kind = options.get("model", "gpt2")
    dropout = option(options, "dropout", 0.1, float)
    step_time = option(options, "step_time", 0.0, float)
    model = gpt2(dropout) if kind == "gpt2" else HandmadeLM(dropout)

    def loss_fn(m: nn.Module, batch):
        (ids,) = batch
        time.sleep(step_time)
        logits = m(input_ids=ids)
        logits = logits.logits if hasattr(logits, "logits") else logits
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)
        )

    return Task(
        model=model,
        dataset=token_dataset(),
        batch_size=16,
        make_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
        loss_fn=loss_fn,
        shard=split_shard if option(options, "split", 0) else None,
        hf_config=model.config.to_dict() if kind == "gpt2" else None,
    )


def split_shard(model: nn.Module, mesh) -> None:
    """A user's ``Task.shard`` that splits the tie: the output layer in a group of its own."""
    from torch.distributed.fsdp import fully_shard

    head = model.lm_head if hasattr(model, "lm_head") else model.head
    fully_shard(head, mesh=mesh)
    fully_shard(model, mesh=mesh)
