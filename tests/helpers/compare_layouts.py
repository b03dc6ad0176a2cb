"""``python -m tests.helpers.compare_layouts [--steps 150] [--activation relu] [--kill-at 77]``:
train ``layout_task`` in each layout (plain ranks, the runner as a user runs it) and print how
far each ends from the unsharded model one process trains on the same global batches
(``layout_task.train_one_rank``): the largest absolute and relative difference over the
tensors, and the optimizer's step count. ``--kill-at S``: rank 1 of each run dies after step S
and the run is launched again, resuming from its newest checkpoint (every 20 steps).
``--skip N``: the first N steps are drawn and not trained (``--skip-steps``). ``--local-tier``:
with the node-memory tier (off otherwise: it does not serve this model's mixed layout). The figures in
docs/layouts.md come from here."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from elastictrain import load_checkpoint
from tests.helpers.layout_task import train_one_rank

LAYOUTS = {
    "ddp-2": (2, ["--parallel", "ddp"]),
    "fsdp-2": (2, ["--parallel", "fsdp"]),
    "hsdp-2x2": (4, ["--parallel", "hsdp", "--mesh", "dp_replicate=2,dp_shard=2"]),
    "tp-2": (2, ["--parallel", "fsdp", "--mesh", "tp=2"]),
    "dp2-tp2": (4, ["--parallel", "fsdp", "--mesh", "dp_shard=2,tp=2"]),
}


def _run(folder: str, nproc: int, args: list[str]) -> int:
    cmd = [sys.executable, "-m", "tests.helpers.plain_ranks", str(nproc), "-m", "elastictrain"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(os.path.join(folder, "log.txt"), "ab") as log:
        return subprocess.run([*cmd, *args], env=env, stdout=log, stderr=log).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--activation", default="gelu", choices=["gelu", "relu"])
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--local-tier", action="store_true", help="keep the node-memory tier on")
    a = p.parse_args(argv)
    options = {"activation": a.activation}
    reference, _, _ = train_one_rank(a.steps, range(a.skip), options=options)
    print(f"one rank: {a.steps - a.skip} optimizer steps")
    print("layout       max abs   max rel  optimizer steps")
    for name in a.layouts.split(","):
        nproc, layout = LAYOUTS[name]
        with tempfile.TemporaryDirectory() as folder:
            args = [
                *("--task", "tests.helpers.layout_task:make_task"),
                *("--task-option", f"activation={a.activation}"),
                *("--checkpoint-dir", os.path.join(folder, "ckpt")),
                *("--max-steps", str(a.steps), "--checkpoint-every-steps", "20"),
                *([] if a.local_tier else ["--no-local-checkpoint"]),
                *layout,
            ]
            if a.skip:
                args += ["--skip-steps", f"0-{a.skip - 1}"]
            if a.kill_at is not None:
                args += ["--task-option", f"kill_at={a.kill_at}"]
                args += ["--task-option", f"kill_marker={os.path.join(folder, 'killed')}"]
                _run(folder, nproc, args)  # dies at the kill
            if _run(folder, nproc, args) != 0:
                print(f"{name}: failed; log in {folder}/log.txt")
                return 1
            got = load_checkpoint(os.path.join(folder, "ckpt"))
        diffs = [
            (float((got["model"][k] - t).abs().max()), float(t.abs().max()))
            for k, t in reference.items()
        ]
        worst = max(d for d, _ in diffs)
        rel = max(d / m for d, m in diffs)
        steps = {float(s["step"]) for s in got["optimizer"]["state"].values()}
        print(f"{name:10} {worst:9.2e} {rel:9.2e} {sorted(steps)!s:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
