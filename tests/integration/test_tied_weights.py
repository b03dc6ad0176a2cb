"""Tied weights (an output layer sharing the input embedding's weight, as GPT-2 and most small
language models do) under FSDP and DDP: the default units keep the tie in one FSDP group, a task
that splits it is refused at start, and the tie survives kills, a resume at another world size,
``load_checkpoint`` and every export (stored once; the loaded model still tied)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from elastictrain.errors import ConfigError
from elastictrain.observe.events import Event, read_events
from elastictrain.tools.export import main as export_main
from tests.helpers.launcher import (
    assert_bitwise_equal,
    final_state,
    toy_args,
    wait_for_event,
)
from tests.helpers.paths import checkpoint_files

pytest.importorskip("transformers")

TIED = ("--task", "tests.helpers.tied_task:make_task")
FSDP = ("--parallel", "fsdp")


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_default_fsdp_units_group_tied_modules_and_a_task_shard_that_splits_them_is_refused(
    one_rank_group,
):
    from elastictrain.train.parallel import default_units, shard
    from tests.helpers.tied_task import HandmadeLM, gpt2, split_shard

    for model, tie in ((gpt2(), {"transformer.wte", "lm_head"}), (HandmadeLM(), {"embed", "head"})):
        names = {id(m): n for n, m in model.named_modules()}
        groups = [{names[id(m)] for m in group} for group in default_units(model)]
        assert tie in groups, groups  # one group holds both ends of the tie...
        assert all(len(g) == 1 for g in groups if g != tie), groups  # ...the rest stay per module
        shard(model, None, torch.device("cpu"), 1)
        ids = torch.randint(0, 96, (2, 16))
        out = model(input_ids=ids)
        (out.logits if hasattr(out, "logits") else out).sum().backward()  # FSDP2 accepted it
    with pytest.raises(ConfigError, match=r"'transformer.wte' and 'lm_head'.*different FSDP"):
        shard(gpt2(), split_shard, torch.device("cpu"), 1)


@pytest.mark.slow
def test_tied_gpt2_under_fsdp_resumes_bitwise_after_a_kill_then_at_one_rank_and_exports(
    launch, tmp_path, capsys
):
    """A GPT-2 (Hugging Face transformers, from a config) with tied embeddings, FSDP at 2 ranks:
    SIGKILL rank 1 after the first checkpoint; the run ends bitwise equal to an uninterrupted one.
    Then it resumes at 1 rank and trains on, the two keys of the tie still equal (an untied resume
    would train them apart). Exported as a Hugging Face folder, ``from_pretrained`` gives the
    logits of the model rebuilt from ``load_checkpoint``, with the tied tensor stored once."""
    from transformers import GPT2LMHeadModel

    from tests.helpers.tied_task import gpt2, gpt2_config

    def args(ckpt: str, steps: int, step_time: float) -> list[str]:
        extra = (*TIED, *FSDP, "--task-option", "dropout=0.1")
        return toy_args(
            ckpt, ckpt + ".jsonl", max_steps=steps, every=10, step_time=step_time, extra=extra
        )

    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = launch(args(ref_dir, 40, 0), name="ref", plain=True)
    job = launch(args(run_dir, 40, 0.05), name="run")
    wait_for_event(run_dir + ".jsonl", lambda e: e["event"] == Event.CHECKPOINT, 120, job)
    job.kill_worker(1)
    assert job.wait(180) == 0, job.log()[-3000:]
    assert ref.wait(180) == 0, ref.log()[-3000:]
    resumes = [e for e in read_events(run_dir + ".jsonl") if e["event"] == Event.RESUME]
    assert [e["fresh"] for e in resumes] == [True, False], resumes
    state = final_state(run_dir)
    assert_bitwise_equal(state, final_state(ref_dir))
    assert state["tied"] == [["transformer.wte.weight", "lm_head.weight"]]

    at_one = launch(args(run_dir, 50, 0), nproc=1, name="at-one")
    assert at_one.wait(180) == 0, at_one.log()[-3000:]
    resumed = [e for e in read_events(run_dir + ".jsonl") if e["event"] == Event.RESUME][-1]
    assert resumed["step"] == 40 and resumed["world_size"] == 1, resumed
    state = final_state(run_dir)
    weights = state["model"]
    assert torch.equal(weights["transformer.wte.weight"], weights["lm_head.weight"])
    assert not torch.equal(
        weights["transformer.wte.weight"], final_state(ref_dir)["model"]["transformer.wte.weight"]
    )

    rebuilt = gpt2(0.0)
    rebuilt.load_state_dict(weights)
    assert rebuilt.lm_head.weight is rebuilt.transformer.wte.weight
    out = str(tmp_path / "hf")  # config.json from the task's Task.hf_config, saved with it
    # In this process: an import of torch and transformers saved (the CLI's own process is
    # test_cli's).
    assert export_main([run_dir, "-o", out, "--max-shard-size", "40KB"]) == 0
    printed = capsys.readouterr().out
    assert "(1 tied, stored once)" in printed, printed
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert (
        len(shards) > 1
        and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    )
    assert (
        "transformer.wte.weight" in index["weight_map"]
        and "lm_head.weight" not in index["weight_map"]
    )
    from safetensors import safe_open

    sizes = 0
    for shard_file in shards:
        with safe_open(os.path.join(out, shard_file), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            sizes += sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # noqa: SIM118 - safe_open is no dict
    assert index["metadata"]["total_size"] == sizes
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    ids = torch.randint(0, 96, (3, 16))
    assert torch.equal(loaded(ids).logits, rebuilt.eval()(ids).logits)
    # --config replaces it: copied as given.
    given = tmp_path / "config.json"
    given.write_text(json.dumps({**gpt2_config(0.0).to_dict(), "note": "mine"}))
    assert export_main([run_dir, "-o", str(tmp_path / "hf2"), "--config", str(given)]) == 0
    assert (tmp_path / "hf2" / "config.json").read_bytes() == given.read_bytes()
    assert os.listdir(tmp_path / "hf2") and "model.safetensors" in os.listdir(tmp_path / "hf2")


@pytest.mark.slow
def test_tied_model_under_ddp_keeps_the_tie_through_a_resume_and_each_single_file_export(
    launch, tmp_path
):
    """The hand-written tied model under DDP at 2 ranks, stopped at 20 and resumed to 30: the
    tie holds; ``.safetensors`` stores the tensor once (``safetensors.torch.load_model`` re-ties
    it) and ``.pt`` keeps both keys on one storage."""
    from safetensors.torch import load_file, load_model

    from tests.helpers.tied_task import HandmadeLM

    ckpt = str(tmp_path / "c")
    extra = (*TIED, "--task-option", "model=handmade")
    for steps in (20, 30):
        job = launch(
            toy_args(ckpt, ckpt + ".jsonl", max_steps=steps, every=10, step_time=0, extra=extra)
        )
        assert job.wait(120) == 0, job.log()[-3000:]
    state = final_state(ckpt)
    assert state["progress"]["step"] == 30 and state["tied"] == [["embed.weight", "head.weight"]]
    assert torch.equal(state["model"]["embed.weight"], state["model"]["head.weight"])
    rebuilt = HandmadeLM(0.0)
    rebuilt.load_state_dict(state["model"])
    ids = torch.randint(0, 96, (3, 16))
    expected = rebuilt.eval()(ids)
    for name, cast in (
        ("m.safetensors", []),
        ("m.pt", []),
        ("bf16.safetensors", ["--dtype", "bfloat16"]),
    ):
        # In this process (the CLI in a process of its own: the GPT-2 test): 3 imports saved.
        assert export_main([ckpt, "-o", str(tmp_path / name), *cast]) == 0
    cast = load_file(str(tmp_path / "bf16.safetensors"))
    assert all(torch.equal(t, state["model"][k].bfloat16()) for k, t in cast.items()), cast.keys()
    assert set(load_file(str(tmp_path / "m.safetensors"))) == set(state["model"]) - {"head.weight"}
    model = HandmadeLM(0.0)
    assert load_model(model, str(tmp_path / "m.safetensors")) == (set(), [])
    assert model.head.weight is model.embed.weight and torch.equal(model.eval()(ids), expected)
    saved = torch.load(str(tmp_path / "m.pt"), weights_only=True)
    assert saved["head.weight"].data_ptr() == saved["embed.weight"].data_ptr()
    model = HandmadeLM(0.0)
    model.load_state_dict(saved)  # strict: every key
    assert torch.equal(model.eval()(ids), expected)


def test_a_task_shard_that_splits_a_tie_stops_at_start_with_exit_2_writing_nothing(
    launch, tmp_path
):
    ckpt = str(tmp_path / "never")
    job = launch(
        [*TIED, *FSDP, "--task-option", "split=1", "--checkpoint-dir", ckpt], max_restarts=0
    )
    assert job.wait(120) != 0
    errors = [line for line in job.log().splitlines() if "FAILED (exit 2): ConfigError" in line]
    assert len(errors) == 2 and all("'transformer.wte' and 'lm_head'" in e for e in errors)
    assert "Traceback" not in job.log().split("FAILED (exit 2)")[0]  # no step was attempted
    # Nothing but the run's history, which records why the start failed: no probe, no fence.
    assert os.listdir(ckpt) == ["events"] and not checkpoint_files(ckpt)
    exits = [n for n in os.listdir(os.path.join(ckpt, "events")) if n.startswith("exit-")]
    assert exits and len(os.listdir(os.path.join(ckpt, "events"))) == len(exits)
