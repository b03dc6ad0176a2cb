"""Manual (docs/measurements.md): what the numerical-fault checks cost beside a step of a 59 MB
model on this host, one thread, side by side in one run.

    python -m tests.helpers.numerics_cost

- the finite check (``numerics.GradientCheck``): every step, the gradient's 2-norm;
- the replicas' digest (``replicas.digest``): every ``--compare-replicas-every`` steps;
- the commit check (``Snapshot.non_finite``): on each copy, off the training thread.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from elastictrain.checkpoint.state.flat import Staging
from elastictrain.train import replicas
from elastictrain.train.numerics import GradientCheck


def _time(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(14)])  # 14.7M params, 59 MB
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    x = torch.randn(64, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    step_s = _time(step, 10)
    check = GradientCheck(sharded=False)
    check_s = _time(lambda: check.finite(model, None), 20)
    digest_s = _time(lambda: replicas.digest(model), 20)
    snap = Staging().snapshot({"model": model.state_dict()})
    commit_s = _time(snap.non_finite, 10)
    print(f"{mb:.1f} MB of parameters, a step (batch 64) {step_s * 1e3:.1f} ms")
    print(f"finite check, every step: {check_s * 1e3:.2f} ms ({check_s / step_s:.1%} of a step)")
    for k in (10, 100):
        print(
            f"replicas' digest, every {k} steps: {digest_s * 1e3:.2f} ms a check, "
            f"{digest_s / k / step_s:.3%} of a step"
        )
    print(f"commit check of a copy (persist thread): {commit_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
