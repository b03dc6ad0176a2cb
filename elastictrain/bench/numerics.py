"""``python -m elastictrain bench numerics``: what the numerical-fault checks cost, beside a
training step of the same model, side by side in one run (``train.numerics``, ``train.replicas``,
docs/faults.md "Numerical faults"):

- the finite check (``numerics.GradientCheck``): every step, the gradient's 2-norm, one host
  sync;
- the replicas' digest (``replicas.digest``): every ``--compare-replicas-every`` steps (xxh3 of
  the bytes on the CPU; on a GPU each tensor's word sum on the device, 8 bytes to the host);
- the commit check (``Snapshot.non_finite``): on each copy, on the persist thread, off the
  training loop's time.

The model is an MLP of ``--size`` of float32 parameters in 1024-wide layers (batch 64), on
``--device``; one thread on the CPU, so the figure is per core.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from elastictrain.checkpoint.state.flat import Staging
from elastictrain.train import replicas
from elastictrain.train.numerics import GradientCheck

WIDTH = 1024


def _time(fn: Callable[[], object], n: int, device: torch.device) -> float:
    """Seconds a call, over ``n`` calls after one to warm up (the device drained each time)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(size: int, device: torch.device, calls: int = 10) -> dict[str, float]:
    """One run: each figure in seconds, and its share of a step."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = max(1, round(size / (WIDTH * WIDTH * 4)))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    x = torch.randn(64, WIDTH, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    step_s = _time(step, calls, device)
    check = GradientCheck(sharded=False)
    check_s = _time(lambda: check.finite(model, None), 2 * calls, device)
    digest_s = _time(lambda: replicas.digest(model), 2 * calls, device)
    snap = Staging().snapshot({"model": {k: v.cpu() for k, v in model.state_dict().items()}})
    commit_s = _time(snap.non_finite, calls, torch.device("cpu"))
    return {
        "params_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6,
        "step_s": step_s,
        "finite_check_s": check_s,
        "finite_check_share": check_s / step_s,
        "digest_s": digest_s,
        "digest_share_at_100": digest_s / 100 / step_s,
        "commit_check_s": commit_s,
    }


def main(size: int, repeats: int, as_json: bool, device: str) -> int:
    dev = torch.device(device)
    runs = [measure(size, dev) for _ in range(max(1, repeats))]
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if as_json:
        print(json.dumps({**median, "device": str(dev), "repeats": len(runs)}))
        return 0
    print(
        f"{median['params_mb']:.1f} MB of parameters on {dev}, a step (batch 64) "
        f"{median['step_s'] * 1e3:.1f} ms (median of {len(runs)})"
    )
    print(
        f"finite check, every step: {median['finite_check_s'] * 1e3:.2f} ms "
        f"({median['finite_check_share']:.1%} of a step)"
    )
    for k in (10, 100):
        print(
            f"replicas' digest, every {k} steps: {median['digest_s'] * 1e3:.2f} ms a check, "
            f"{median['digest_s'] / k / median['step_s']:.3%} of a step"
        )
    print(f"commit check of a copy (persist thread): {median['commit_check_s'] * 1e3:.1f} ms")
    return 0
