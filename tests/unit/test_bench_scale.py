"""``bench scale`` at small W: every phase runs through the runner's own code, its counts come from
the storage and store the code really used, and a phase its growth puts over budget is skipped."""

from __future__ import annotations

import json

import pytest

from elastictrain.bench import commands, scale


def test_every_phase_runs_the_real_code_and_counts_what_it_asked_for():
    rows = scale.measure([4, 16], latency_ms=1.0, tensors=12, budget_s=300)
    by = {(r.phase, r.world): r for r in rows}
    assert {p for p, _ in by} == set(scale.PHASES) and all(r.seconds for r in rows), rows
    # The handshake: a few requests per rank, however many ranks (no polling).
    assert by["handshake", 4].requests <= 6 * 4 and by["handshake", 16].requests <= 6 * 16
    # The commit gathers the receipts through the store: the same storage and store requests at
    # any W, while the receipts' bytes (and only they) grow with W ...
    assert by["commit", 16].requests == by["commit", 4].requests
    assert (
        by["commit", 16].note.split("receipts: ")[1] == by["commit", 4].note.split("receipts: ")[1]
    )
    assert by["commit", 16].metadata_bytes > 3 * by["commit", 4].metadata_bytes
    # ... and the checks before a resume make the same requests at any W (one listing).
    assert by["resume-checks", 4].requests == by["resume-checks", 16].requests
    # Rank 0 at 3W/4 holds rows 0-1 of each 16-row tensor: two saved chunks each, planned alone.
    assert "rank 0 of 12: 24 read items" in by["resume-plan", 16].note


@pytest.mark.parametrize("layout", ["hsdp", "tp"])
def test_the_2d_layouts_commit_an_index_that_does_not_grow_with_w_and_plan_alike(layout):
    """HSDP (W/8 replicas of 8 shards) and (dp_shard W/2, tp 2): the index is format 3, one line
    per tensor, the same size at any W; a rank plans the same reads at any W."""
    rows = scale.measure(
        [16, 64],
        latency_ms=0.0,
        tensors=12,
        budget_s=300,
        phases=("commit", "resume-plan"),
        layout=layout,
    )
    by = {(r.phase, r.world): r for r in rows}
    notes = {w: by["commit", w].note for w in (16, 64)}
    assert all("format 3)" in n for n in notes.values()), notes
    size = {w: int(n.split("(")[1].split(" B")[0]) for w, n in notes.items()}
    assert size[64] <= 1.05 * size[16], size  # a wider mesh only lengthens a few numbers
    assert by["commit", 16].requests == by["commit", 64].requests
    items = {w: by["resume-plan", w].note.split(": ")[1] for w in (16, 64)}
    assert items[16] == items[64] == ("12 read items" if layout == "hsdp" else "24 read items")


def test_a_phase_whose_growth_would_pass_the_budget_is_skipped_and_says_so():
    rows = scale.measure([4, 4096], latency_ms=0.0, tensors=6, budget_s=0.001,
                         phases=("commit", "resume-checks"))  # fmt: skip
    skipped = [r for r in rows if r.world == 4096]
    assert len(skipped) == 2 and all(r.seconds is None for r in skipped), skipped
    assert all("not run: ~" in r.note and "--budget-s" in r.note for r in skipped)


def test_growth_is_the_slope_of_log_figure_on_log_w():
    rows = [scale.Row("x", w, requests=3 * w, seconds=0.5) for w in (8, 64, 512)]
    assert scale.growth(rows, "requests") == 1.0 and scale.growth(rows, "seconds") == 0.0


def test_the_command_prints_json_rows(capsys):
    assert commands.main(["scale", "--worlds", "4", "--tensors", "3", "--latency-ms", "0",
                          "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert {r["phase"] for r in out["rows"]} == set(scale.PHASES) and out["tensors"] == 3
