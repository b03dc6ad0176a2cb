"""The synthetic training state the checkpoint benches measure."""

from __future__ import annotations

from typing import Any

import torch


def synthetic_state(nbytes: int, tensor_bytes: int = 64 << 20) -> dict[str, Any]:
    """About ``nbytes`` of float32: weights (1/3) and two Adam moments (2/3), in ~64 MB tensors."""
    per_kind = max(nbytes // 3 // 4, 1)
    sizes = [tensor_bytes // 4] * (per_kind // (tensor_bytes // 4)) + [
        per_kind % (tensor_bytes // 4)
    ]
    sizes = [n for n in sizes if n]
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    moments = {
        i: {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g)}
        for i, n in enumerate(sizes)
    }
    return {"model": model, "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3}]}}


def tensors_in(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_in(v)]
    return []


def moved_to(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: moved_to(v, device) for k, v in tree.items()}
    return tree
