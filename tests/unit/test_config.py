"""elastictrain.config and elastictrain.flags: every setting declared once, its flag, its validation."""

from __future__ import annotations

import pytest

from elastictrain.errors import ConfigError
from elastictrain.flags import parse_args


def test_defaults():
    cfg = parse_args([])
    assert cfg.checkpoint.checkpoint_dir == "./checkpoints"
    assert cfg.task == "elastictrain.toy:make_task"
    assert cfg.checkpoint.checkpoint_every_steps == 100 and cfg.checkpoint.keep_last == 3


def test_flags_parse():
    cfg = parse_args(
        [
            "--checkpoint-dir",
            "s3://b/run",
            "--storage-option",
            "endpoint_url=http://x:1",
            "--task-option",
            "hidden=32",
            "--task-option",
            "step_time=0.1",
            "--max-steps",
            "7",
            "--checkpoint-every-steps",
            "0",
            "--checkpoint-every-seconds",
            "30",
            "--keep-last",
            "2",
            "--seed",
            "5",
            "--init-timeout",
            "60",
            "--collective-timeout",
            "45",
            "--event-log",
            "e.jsonl",
        ]
    )
    ckpt = cfg.checkpoint
    assert ckpt.storage_options == {"endpoint_url": "http://x:1"}
    assert cfg.task_options == {"hidden": "32", "step_time": "0.1"}
    assert ckpt.checkpoint_every_steps is None and ckpt.checkpoint_every_seconds == 30
    assert (cfg.max_steps, ckpt.keep_last, cfg.seed, cfg.init_timeout, cfg.collective_timeout) == (
        7,
        2,
        5,
        60,
        45,
    )


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--max-steps", "0"], "--max-steps must be > 0, got 0"),
        (["--keep-last", "0"], "--keep-last must be > 0"),
        (["--init-timeout", "-1"], "--init-timeout"),
        (["--task", "nocolon"], "MODULE:CALLABLE"),
        (
            ["--straggler-action", "evict"],
            "--straggler-action evict drops a node in place: add --replace-in-place",
        ),
        (["--min-nodes", "0"], "--min-nodes must be 1 or more, got 0"),
        (["--spare-nodes", "-1"], "--spare-nodes must be 0 or more, got -1"),
        (["--spare-nodes", "1"], "--spare-nodes 1: a spare node takes .* add --replace-in-place"),
        (
            ["--replace-in-place", "--straggler-action", "replace"],
            "--straggler-action replace hands .* add --spare-nodes N",
        ),
        (["--max-evictions-per-hour", "-1"], "--max-evictions-per-hour must be 0 or more"),
    ],
)
def test_bad_values_name_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)


def test_bad_key_value_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--storage-option", "no_equals_sign"])
    assert "KEY=VALUE" in capsys.readouterr().err


def test_fault_flags():
    cfg = parse_args(
        ["--hang-timeout", "30", "--preempt-signal", "SIGUSR1", "--preempt-signal", "SIGTERM"]
    )
    assert cfg.hang_timeout == 30 and cfg.checkpoint.preempt_signals == ("SIGUSR1", "SIGTERM")
    assert parse_args([]).checkpoint.preempt_signals == ("SIGTERM",)
    with pytest.raises(ConfigError, match="--hang-timeout must be > 0"):
        parse_args(["--hang-timeout", "0"])
    with pytest.raises(ConfigError, match="not a signal name"):
        parse_args(["--preempt-signal", "SIGBOGUS"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--precision", "fp8"], "invalid choice"),
        (["--grad-accum-steps", "0"], "--grad-accum-steps must be a positive whole number, got 0"),
        (["--prefetch-factor", "4"], "--prefetch-factor 4 needs loader workers"),
        (["--num-workers", "-1"], "--num-workers must be 0 or more, got -1"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0, got 0.0"),
    ],
)
def test_bad_real_job_flags_name_the_flag(argv, message, capsys):
    try:
        parse_args(argv)
    except SystemExit:  # argparse's own choices check
        assert message in capsys.readouterr().err
    except ConfigError as e:
        assert message in str(e)
    else:
        pytest.fail(f"{argv} was accepted")


def test_every_config_field_is_a_flag_and_every_flag_a_field():
    """The parser is built from the two dataclasses: no flag without a field, no field without one."""
    from dataclasses import fields

    from elastictrain.config import CheckpointConfig, RunConfig, settings
    from elastictrain.flags import build_parser

    dests = {a.dest for a in build_parser()._actions} - {"help"}
    assert dests == set(settings(RunConfig)) | set(settings(CheckpointConfig))
    assert {f.name for f in fields(RunConfig)} - set(settings(RunConfig)) == {"checkpoint"}


def test_the_managers_keywords_are_the_checkpoint_config_and_each_reaches_the_session(tmp_path):
    """CheckpointManager takes exactly CheckpointConfig's fields (plus map_location and
    hang_timeout); a value given for each one is the value its session runs with."""
    import inspect

    from elastictrain import CheckpointManager
    from elastictrain.config import CheckpointConfig, settings

    params = set(inspect.signature(CheckpointManager).parameters)
    assert params == set(settings(CheckpointConfig)) | {"map_location", "hang_timeout"}
    given = dict(
        checkpoint_dir=str(tmp_path / "c"),
        storage_options={"auto_mkdir": True},
        checkpoint_every_steps=7,
        checkpoint_every_seconds=11.0,
        keep_last=5,
        keep_every_steps=1000,
        async_checkpoint=False,
        storage_retry_deadline=9.0,
        on_storage_failure="fail",
        resume_read="all",
        checkpoint_timeout=33.0,
        preempt_signals=(),
        event_log=str(tmp_path / "ev.jsonl"),
        checksum="sha256",
        local_checkpoint=False,
        local_checkpoint_dir=str(tmp_path / "local"),
        local_every_steps=3,
        local_overhead=0.05,
    )
    assert set(given) == set(settings(CheckpointConfig))  # a new field must be added here too
    with CheckpointManager(**given) as ckpt:
        assert ckpt.config == CheckpointConfig(**given)
        assert {n: getattr(ckpt.config, n) for n in given} == given
    with pytest.raises(ConfigError, match="unknown argument 'keep_lst'; did you mean keep_last"):
        CheckpointManager(str(tmp_path / "c"), keep_lst=2)


def test_the_old_keyword_names_still_work_for_a_release_and_say_the_new_one(tmp_path):
    import warnings

    from elastictrain import CheckpointManager

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = CheckpointManager(
            url=str(tmp_path / "c"), every_steps=4, async_save=False, timeout_s=60.0,
            preempt_signals=(),
        )  # fmt: skip
    said = sorted(str(w.message) for w in caught if w.category is FutureWarning)
    assert said == [
        f"CheckpointManager({old}=...) is deprecated: use {new}=..."
        for old, new in sorted({"async_save": "async_checkpoint", "every_steps":
            "checkpoint_every_steps", "timeout_s": "checkpoint_timeout", "url":
            "checkpoint_dir"}.items())
    ]  # fmt: skip
    cfg = ckpt.config
    assert (cfg.checkpoint_dir, cfg.checkpoint_every_steps) == (str(tmp_path / "c"), 4)
    assert (cfg.async_checkpoint, cfg.checkpoint_timeout) == (False, 60.0)
    ckpt.close()


def test_choices_are_the_literal_types_and_checksums_are_the_storage_layers():
    from typing import get_args

    from elastictrain.config import CheckpointConfig, Checksum, flag
    from storage.hashing import ALGORITHMS

    assert set(get_args(Checksum)) == set(ALGORITHMS)
    with pytest.raises(ConfigError, match="resume_read must be 'rank0' or 'all', got 'some'"):
        CheckpointConfig(resume_read="some")
    with pytest.raises(ConfigError, match="--checksum must be 'xxh3' or 'sha256', got 'md5'"):
        CheckpointConfig(checksum="md5", spell=flag)  # the runner's spelling of the same rule


def test_each_setting_is_declared_once():
    """No layer re-declares a checkpoint setting (a field, or a parameter with a default, of the
    same name or a renamed one): the config is passed down whole."""
    import ast
    import pathlib

    from elastictrain.config import CheckpointConfig, settings
    from tests.helpers.paths import REPO_ROOT

    names = set(settings(CheckpointConfig))
    renamed = {"url", "every_steps", "every_seconds", "async_save", "timeout_s", "gate_timeout_s",
               "reports_timeout_s", "async_persist", "read_mode", "on_failure", "keep_every",
               "retry_deadline"}  # fmt: skip
    found = []
    layers = ["train/runner", "checkpoint/session", "checkpoint/checkpointer", "checkpoint/write/persist",
              "checkpoint/tiers/local", "checkpoint/resume/ranking", "checkpoint/write/layouts"]  # fmt: skip
    for layer in layers:
        path = pathlib.Path(REPO_ROOT, "elastictrain", f"{layer}.py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    declared = isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    if declared and item.target.id in names | renamed:
                        found.append(f"{path.name}: {node.name}.{item.target.id}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                with_default = args.args[len(args.args) - len(args.defaults) :] + [
                    a for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d
                ]
                bad = [a.arg for a in with_default if a.arg in names | renamed]
                bad += [a.arg for a in args.args + args.kwonlyargs if a.arg in renamed]
                found += [f"{path.name}: {node.name}({a}=...)" for a in bad]
    assert not found, found
