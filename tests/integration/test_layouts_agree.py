"""Every sharded layout trains what one rank trains: the same task (``tests/helpers/layout_task.py``:
a residual MLP under AdamW, tensor-parallel and replicated layers in one model) on the same global
batches ends within 1e-5 (relative) of the unsharded model that one process trains with a plain
loop here, loss for loss at every step: FSDP at 2 ranks, tensor parallelism at tp=2 (killed and
resumed) and at dp_shard=2,tp=2.

The reference is this file's own loop (the runner's sampler, the task's optimizer and loss), not
another run of the runner, so a fault every layout shares (an extra optimizer step, a batch drawn
wrong) cannot hide behind a run that has it too. The first steps are skipped, so the first
checkpoint is of an optimizer that has not stepped: the case in which DCP's state dict used to
give Adam a step of its own (``elastictrain/checkpoint/state/dcp.py``).

What differs, and why it is bounded: the ranks' partial sums are added in another order than
one process's matrix products add them (the gradients' reduce-scatter, a row-wise layer's
all-reduce), so weights differ in their last bits: at most 2e-7 absolute (6.3e-7 relative)
over 150 steps (``python -m tests.helpers.compare_layouts``), and within ``REL`` here.

Plain ranks, no torchrun (``launch(..., plain=True)``): the kill is the task's own SIGKILL after
a step, and the resume a new launch, as torchrun's restart would start one."""

from __future__ import annotations

import pytest

from elastictrain import load_checkpoint
from elastictrain.observe.events import Event, read_events, read_sample_log
from tests.helpers.elastic import assert_exactly_once, committed_history
from tests.helpers.layout_task import BATCH_SIZE, DATASET_SIZE, train_one_rank
from tests.helpers.tp_task import read_losses

STEPS = 80
SKIPPED = range(20)
"""Drawn and not trained (``--skip-steps``), so the checkpoint at step 20 is taken of an
optimizer that has not stepped: DCP's capture ran one at lr 0, an extra step to Adam (a sharded
run 0.056 off after 150 steps; its Adam step count one ahead)."""
KILL_AT = 50
"""Rank 1 of the tensor-parallel run dies after this step; it resumes from step 40."""
REL = 1e-5
"""The largest difference from the one-rank model over any tensor, relative to that tensor's
largest magnitude; and a loss's relative difference."""
LAYOUTS = {
    "fsdp-2": (2, 1, ("--parallel", "fsdp")),
    "tp-2": (2, 2, ("--parallel", "fsdp", "--mesh", "tp=2")),
    "dp2-tp2": (4, 2, ("--parallel", "fsdp", "--mesh", "dp_shard=2,tp=2")),
}
"""name -> (ranks, tensor-parallel size, flags)."""
KILLED = "tp-2"


def _args(folder, layout, *extra) -> list[str]:
    return [
        *("--task", "tests.helpers.layout_task:make_task"),
        *("--task-option", f"loss_log={folder}"),
        *("--checkpoint-dir", str(folder / "ckpt")),
        *("--event-log", str(folder / "events.jsonl")),
        *("--sample-log", str(folder / "samples")),
        *("--max-steps", str(STEPS)),
        *("--checkpoint-every-steps", "20"),
        *("--skip-steps", f"{SKIPPED.start}-{SKIPPED.stop - 1}"),
        "--no-local-checkpoint",  # this model's mixed layout resumes from the durable tier
        *layout,
        *extra,
    ]


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_train_what_one_rank_trains_through_a_kill(launch, tmp_path):
    kill = (
        *("--task-option", f"kill_at={KILL_AT}"),
        *("--task-option", f"kill_marker={tmp_path / 'killed'}"),
    )
    folders, jobs = {}, {}
    for name, (nproc, _, layout) in LAYOUTS.items():
        folders[name] = tmp_path / name
        folders[name].mkdir()
        extra = kill if name == KILLED else ()
        jobs[name] = launch(
            _args(folders[name], layout, *extra), nproc=nproc, plain=True, name=name
        )
    reference, losses, batches = train_one_rank(STEPS, SKIPPED)  # meanwhile, in this process
    for name, job in jobs.items():
        code = job.wait(240)
        assert code == (128 + 9 if name == KILLED else 0), f"{name}: {job.log()[-3000:]}"
    # The killed run again, as torchrun's restart would: it resumes from its newest checkpoint.
    nproc, _, layout = LAYOUTS[KILLED]
    again = launch(_args(folders[KILLED], layout, *kill), nproc=nproc, plain=True, name="again")
    assert again.wait(240) == 0, again.log()[-3000:]
    resumed = [
        e
        for e in read_events(str(folders[KILLED] / "events.jsonl"))
        if e["event"] == Event.RESUME and not e["fresh"]
    ]
    assert [e["step"] for e in resumed] == [40], resumed  # the newest commit before the kill

    for name, (nproc, tp, _) in LAYOUTS.items():
        got = load_checkpoint(str(folders[name] / "ckpt"))
        assert got["progress"]["step"] == STEPS, name
        assert got["model"].keys() == reference.keys(), name
        for key, want in reference.items():
            worst = float((got["model"][key] - want).abs().max())
            assert worst <= REL * float(want.abs().max()), (name, key, worst)
        by_rank = [read_losses(str(folders[name]), rank) for rank in range(nproc)]
        assert by_rank[0].keys() == losses.keys(), name  # the trained steps, and only those
        for step, loss in losses.items():
            # The global batch's loss: the mean of the data-parallel ranks' (equal shares) ...
            shares = [by_rank[rank][step] for rank in range(0, nproc, tp)]
            assert sum(shares) / len(shares) == pytest.approx(loss, rel=REL), (name, step)
            # ... and one loss per tensor-parallel group: its ranks compute it together.
            for rank in range(nproc):
                assert by_rank[rank][step] == by_rank[rank - rank % tp][step], (name, rank, step)
        # The same samples at every step, recorded once per tensor-parallel group.
        ledger = read_sample_log(str(folders[name] / "samples"))
        data_ranks = nproc // tp
        recorded = {(e["rank"], e["world_size"]) for e in ledger}
        assert recorded == {(r, data_ranks) for r in range(data_ranks)}, name
        assert _by_step(ledger) == batches, name
    assert_exactly_once(
        read_sample_log(str(folders[KILLED] / "samples")),
        dataset_size=DATASET_SIZE,
        batch_size=BATCH_SIZE,
        max_steps=STEPS,
    )


def _by_step(entries: list[dict]) -> dict[int, list[int]]:
    """Step -> the samples its committed history trained, in order of (data-parallel rank,
    micro-batch): a step redone after a kill counts once, as its last attempt drew it."""
    out: dict[int, list[int]] = {}
    for step, rows in sorted(committed_history(entries).items()):
        for e in sorted(rows, key=lambda e: (e["rank"], e["micro"])):
            out.setdefault(step, []).extend(e["indices"])
    return out
