"""``export`` streams: a tensor is read, cast and written at a time, so the memory it adds stays
near the largest tensor, not the model, and it never reads the optimizer state beside it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launcher import run_single


def _helper(*args: str, cwd: str) -> str:
    out = run_single(list(args), cwd, module="tests.helpers.export_memory")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # each format 25 to 34 s in the quick tier (2026-12-07): over its 20 s line
@pytest.mark.parametrize("output", ["m.safetensors", "m.pt", "hf"])
def test_export_adds_memory_near_the_largest_tensor_not_the_model(tmp_path_factory, output):
    root = tmp_path_factory.getbasetemp() / "export-streams"
    if not (root / "ck").exists():  # one 100 MB model (300 MB with AdamW's moments) for all three
        root.mkdir(exist_ok=True)
        _helper("make", str(root / "ck"), "100", cwd=str(root))
    line = _helper("export", str(root / "ck"), str(root / output), cwd=str(root))
    seen = json.loads(line.split("EXPORT_MEMORY ", 1)[1])
    assert seen["model_mb"] >= 99 and seen["largest_tensor_mb"] == 10, seen
    # Reading the whole model would add >= 100 MB (the old export added the checkpoint: 300).
    assert seen["added_mb"] < 4 * seen["largest_tensor_mb"] + 15, seen
