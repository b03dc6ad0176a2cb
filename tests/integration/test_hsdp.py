"""HSDP (replicas of an FSDP shard group) through real torchrun jobs on CPU/gloo, in library
mode: each shard is written once per checkpoint, the writes spread over the replicas, and the
checkpoint resumes as FSDP at another world size and as DDP at one rank with every tensor equal;
and a DDP checkpoint resumes as FSDP. (The model here shards itself over a 2-D mesh of its own,
as a user's own code would; the runner's mesh, and HSDP resumed as HSDP bitwise after a kill, are
test_tensor_parallel.py's.)"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from elastictrain import load_checkpoint
from storage.manifest import parse_step_dir

PROBE = ("-m", "tests.helpers.fsdp_probe")
WIDTH = "width=256"  # ~0.8 MB of state: the shards, not the metadata, decide the ratio


def _newest(ckpt: str) -> str:
    steps = [s for s in (parse_step_dir(n) for n in os.listdir(ckpt)) if s is not None]
    return os.path.join(ckpt, next(n for n in os.listdir(ckpt) if parse_step_dir(n) == max(steps)))


def _sizes(step_dir: str) -> dict[str, int]:
    return {n: os.path.getsize(os.path.join(step_dir, n)) for n in os.listdir(step_dir)}


@pytest.mark.slow
def test_hsdp_writes_each_shard_once_spread_over_replicas_and_moves_to_fsdp_and_ddp_and_back_exactly(
    launch, tmp_path
):
    hsdp, ref = str(tmp_path / "hsdp"), str(tmp_path / "saved.pt")
    job = launch(
        ["save", hsdp, ref, "6", "replicas=2", WIDTH], nproc=4, entry=PROBE, name="hsdp", plain=True
    )
    assert job.wait(180) == 0, job.log()[-3000:]
    h = _sizes(_newest(hsdp))
    shards = {n: b for n, b in h.items() if n.startswith("shard-")}
    assert len(shards) == 4
    by_replica = [sum(b for n, b in shards.items() if f"-r0000{r}-" in n) for r in range(4)]
    replica0, replica1 = by_replica[0] + by_replica[1], by_replica[2] + by_replica[3]
    total = replica0 + replica1
    assert 0.35 * total <= replica0 <= 0.65 * total, by_replica  # about 1/R each
    # load_checkpoint (and so export) consolidates it: every tensor once, as saved.
    saved = torch.load(ref, weights_only=True)["model"]
    consolidated = load_checkpoint(hsdp)["model"]
    assert consolidated.keys() == saved.keys()
    assert all(torch.equal(consolidated[k], saved[k]) for k in saved)
    # Moved to FSDP over 2 ranks, and to the replicated layout (DDP) at one rank, which
    # consolidates it: every tensor of the model and AdamW equal to what was saved. (Resumed as
    # HSDP 2x2, bitwise after a kill: test_tensor_parallel.py, through the same session.)
    whole, after_ddp = str(tmp_path / "hsdp-whole"), str(tmp_path / "after-ddp.pt")
    shutil.copytree(hsdp, whole)  # each resume saves again: one copy each
    resumed = {
        "fsdp": launch(
            ["resume", hsdp, ref, "2", WIDTH], nproc=2, entry=PROBE, name="as-fsdp", plain=True
        ),
        "ddp": launch(
            ["resume", whole, ref, "2", "replicas=0", WIDTH, f"out={after_ddp}"],
            nproc=1,
            entry=PROBE,
            name="as-ddp",
            plain=True,
        ),
    }
    for name, job in resumed.items():
        assert job.wait(180) == 0, f"{name}: {job.log()[-3000:]}"
        assert '"differs": []' in job.log(), f"{name}: {job.log()[-3000:]}"
    # And back: the DDP run's checkpoint (the whole model on the rank, one flat file) read by an
    # FSDP run at 2 ranks, each keeping its shards; the optimizer's numbered parameters named.
    job = launch(
        ["resume", whole, after_ddp, "2", WIDTH],
        nproc=2,
        entry=PROBE,
        name="ddp-as-fsdp",
        plain=True,
    )
    assert job.wait(180) == 0, job.log()[-3000:]
    assert '"resumed": 8, "differs": []' in job.log(), job.log()[-3000:]
    # The FSDP run saved the same model at 2 ranks (step 8) beside the HSDP checkpoint (step 6).
    # Every replica used to write its shard: 2x the FSDP checkpoint at 2 ranks (issue 35).
    f = _sizes(_newest(hsdp))
    assert sum(1 for n in f if n.startswith("shard-")) == 2, f
    assert sum(h.values()) <= 1.05 * sum(f.values()), (h, f)
