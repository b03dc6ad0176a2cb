"""Checkpoints an earlier release wrote keep resuming: the bytes under tests/fixtures/format1/ were
committed by format 1's code (tests/fixtures/make_format1.py says how), and each test resumes a
copy. A checkpoint in a newer format than this code reads stops the run and is left as it was."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from elastictrain import CheckpointManager, load_checkpoint
from elastictrain.errors import NewerFormatError
from storage.manifest import FORMAT_VERSION
from tests.helpers import fsdp_probe
from tests.helpers.one_process import build

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "format1"


def _copy(name: str, tmp_path) -> pathlib.Path:
    """A copy: the committed fixture itself is never written to."""
    return pathlib.Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_format_1_ddp_checkpoint_resumes_exactly(tmp_path):
    where = _copy("ddp", tmp_path)
    expected = torch.load(where / "expected.pt", weights_only=True)
    model, opt, sched = build(seed=1)  # other weights: only the checkpoint can make them equal
    with CheckpointManager(str(where), preempt_signals=(), local_checkpoint=False) as ckpt:
        assert ckpt.resume(model, opt, sched) == 3 and ckpt.extra == {"seen": 3}
    assert _tensors_equal(model.state_dict(), expected["model"])
    assert _tensors_equal(opt.state_dict(), expected["optimizer"])
    assert sched.state_dict() == expected["scheduler"]
    assert load_checkpoint(str(where))["progress"]["step"] == 3


def test_a_format_1_sharded_checkpoint_saved_at_2_ranks_resumes_at_1(tmp_path, gloo_world):
    where = _copy("fsdp", tmp_path)
    model, optimizer = fsdp_probe.build()  # sharded over this one-rank world
    with CheckpointManager(str(where), preempt_signals=(), local_checkpoint=False) as ckpt:
        assert ckpt.resume(model, optimizer) == 5
    saved = torch.load(where / "expected.pt", weights_only=True)
    assert fsdp_probe.equal(fsdp_probe.full_state(model, optimizer), saved) == []


def test_a_checkpoint_in_a_newer_format_stops_the_run_and_is_left_as_it_was(tmp_path, gloo_world):
    where = _copy("ddp", tmp_path)
    manifest = where / "step-000000000003" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["format_version"] = FORMAT_VERSION + 1
    manifest.write_text(json.dumps(doc))
    before = {p: p.read_bytes() for p in where.rglob("*") if p.is_file()}
    model, opt, sched = build()
    ckpt = CheckpointManager(str(where), preempt_signals=(), local_checkpoint=False)
    with pytest.raises(NewerFormatError, match=f"in format {FORMAT_VERSION + 1}, newer than"):
        ckpt.resume(model, opt, sched)
    ckpt.close()
    after = {p: p.read_bytes() for p in where.rglob("*") if p.is_file() and "events" not in p.parts}
    assert after == before  # not skipped as corrupt, not fenced, not deleted
    with pytest.raises(NewerFormatError, match="Upgrade elastictrain"):
        load_checkpoint(str(where))


def test_a_sharded_index_of_a_newer_format_is_refused_as_newer_not_as_corrupt():
    from elastictrain.checkpoint.sharded.reader import Index
    from storage import CheckpointCorruptError

    newer = json.dumps({"format": "elastictrain-sharded/4", "tensors": {}}).encode()
    with pytest.raises(NewerFormatError, match=r"elastictrain-sharded/4, newer than this"):
        Index.parse(newer, "step 5")
    for known in ("elastictrain-sharded/1", "elastictrain-sharded/2", "elastictrain-sharded/3"):
        assert Index.parse(json.dumps({"format": known}).encode(), "step 5").doc["format"] == known
    with pytest.raises(CheckpointCorruptError, match="unsupported index format"):
        Index.parse(json.dumps({"format": "something-else/1"}).encode(), "step 5")
