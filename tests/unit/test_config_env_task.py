from __future__ import annotations

import os

import pytest

from elastictrain.config import parse_args
from elastictrain.env import read_env
from elastictrain.errors import ConfigError, TaskLoadError
from elastictrain.task import build_task


def test_defaults():
    cfg = parse_args([])
    assert cfg.checkpoint_dir == "./checkpoints"
    assert cfg.task == "elastictrain.toy:make_task"
    assert cfg.checkpoint_every_steps == 100 and cfg.keep_last == 3


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
    assert cfg.storage_options == {"endpoint_url": "http://x:1"}
    assert cfg.task_options == {"hidden": "32", "step_time": "0.1"}
    assert cfg.checkpoint_every_steps is None and cfg.checkpoint_every_seconds == 30
    assert (cfg.max_steps, cfg.keep_last, cfg.seed, cfg.init_timeout, cfg.collective_timeout) == (
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
    ],
)
def test_bad_values_name_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)


def test_bad_key_value_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--storage-option", "no_equals_sign"])
    assert "KEY=VALUE" in capsys.readouterr().err


def test_env_outside_torchrun_is_single_process():
    env = read_env({})
    assert (env.rank, env.world_size, env.launched_by_torchrun) == (0, 1, False)


def test_env_under_torchrun():
    env = read_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    assert (env.rank, env.local_rank, env.restart_count, env.use_agent_store) == (3, 1, 2, True)
    with pytest.raises(ConfigError, match="RANK=4 is outside WORLD_SIZE=4"):
        read_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="MASTER_PORT='x'"):
        read_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "x"})


def test_task_loading_errors():
    with pytest.raises(TaskLoadError, match="cannot import module 'no_such_module_xyz'"):
        build_task("no_such_module_xyz:make", {})
    with pytest.raises(TaskLoadError, match="has no callable 'nope'"):
        build_task("elastictrain.toy:nope", {})
    with pytest.raises(TaskLoadError, match="expected elastictrain.Task"):
        build_task("builtins:dict", {})


def test_toy_options():
    task = build_task(
        "elastictrain.toy:make_task",
        {"hidden": "16", "layers": "3", "dataset_size": "100", "batch_size": "10"},
    )
    assert task.model.net1.out_features == 16 and len(task.model.extra) == 2
    assert len(task.dataset) == 100 and task.batch_size == 10
    with pytest.raises(ConfigError, match="hidden='abc' is not a valid int"):
        build_task("elastictrain.toy:make_task", {"hidden": "abc"})
    with pytest.raises(ConfigError, match="Unknown toy --task-option"):
        build_task("elastictrain.toy:make_task", {"hiden": "3"})
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        build_task("elastictrain.toy:make_task", {"dataset_size": "5", "batch_size": "10"})


def test_fault_flags():
    cfg = parse_args(
        ["--hang-timeout", "30", "--preempt-signal", "SIGUSR1", "--preempt-signal", "SIGTERM"]
    )
    assert cfg.hang_timeout == 30 and cfg.preempt_signal == ["SIGUSR1", "SIGTERM"]
    assert parse_args([]).preempt_signal == ["SIGTERM"]
    with pytest.raises(ConfigError, match="--hang-timeout must be > 0"):
        parse_args(["--hang-timeout", "0"])
    with pytest.raises(ConfigError, match="not a signal name"):
        parse_args(["--preempt-signal", "SIGBOGUS"])


def test_readme_flag_table_lists_every_flag_with_its_real_default():
    """The README is the user's manual: its Flags table must name every flag and its default."""
    import re

    from elastictrain.config import RunConfig, build_parser

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")) as f:
        readme = f.read()
    table = readme[readme.index("## Flags") : readme.index("**Exit codes.**")]
    documented = {}
    for row in re.findall(r"^\| `(--[^`]+)`(?: / `[^`]+`)? \|\s*([^|]*?)\s*\|", table, re.M):
        documented[row[0].split()[0]] = row[1].strip().strip("`")
    defaults = RunConfig()
    for action in build_parser()._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in (None, "--help", "--no-async-checkpoint"):
            continue
        assert flag in documented, f"README's Flags table lacks {flag}"
        value = getattr(defaults, action.dest)
        if value is None:
            want: tuple[str, ...] = ("off", "none")
        elif isinstance(value, bool):
            want = ("on",) if value else ("off",)
        elif isinstance(value, (list, dict)):
            want = (", ".join(value),)  # repeatable flags: empty, or the defaults they start with
        else:
            want = (f"{value:g}",) if isinstance(value, float) else (str(value),)
        assert documented[flag] in want, f"README says {flag} defaults to {documented[flag]!r}"


def test_readme_event_table_lists_every_event_and_cause():
    """The event log's names are an enum; the README's table must name each one, and nothing else,
    and the exit event's documented causes must be the Cause enum's."""
    import re

    from elastictrain.observe.events import Cause, Event

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")) as f:
        readme = f.read()
    start = readme.index("## Event log (`--event-log`)")
    table = readme[start : readme.index("\n## ", start + 1)]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", table, re.M))
    assert set(rows) == {e.value for e in Event}, set(rows) ^ {e.value for e in Event}
    for cause in Cause:
        assert f"`{cause.value}`" in rows[Event.EXIT], f"README's exit row lacks cause {cause}"
