"""elastictrain.cluster.env: where this process sits, read from torchrun's environment (and only there)."""

from __future__ import annotations

import os

import pytest

from elastictrain.cluster.env import read_env
from elastictrain.errors import ConfigError


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
    assert env.agent_pid is None  # no TORCHELASTIC_RUN_ID: no agent started this process
    under = read_env({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job7"})
    assert under.under_agent and under.agent_pid == os.getppid()
    with pytest.raises(ConfigError, match="RANK=4 is outside WORLD_SIZE=4"):
        read_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="MASTER_PORT='x'"):
        read_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "x"})


@pytest.mark.parametrize(
    ("torchrun_args", "least"),
    [
        (["--nnodes=1:4", "--nproc-per-node=8"], 1),
        (["--nnodes", "2", "--nproc-per-node=8"], 2),
        (["--standalone", "--nproc-per-node=2"], 1),
    ],
)
def test_the_least_node_count_is_torchruns_own_from_the_agents_command_line(
    monkeypatch, torchrun_args, least
):
    """--min-nodes' default: what the agent was told (``--nnodes=MIN:MAX``), parsed by torchrun's
    own parser; nothing where the agent is not torchrun."""
    from elastictrain.cluster import env as env_module

    agent = ["/usr/bin/python", "-m", "torch.distributed.run", *torchrun_args, "train.py"]
    worker = read_env(
        {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r", "GROUP_RANK": "3"}
    )
    assert worker.node_rank == 3
    monkeypatch.setattr(env_module, "_agent_argv", lambda _: agent)
    assert env_module.min_nodes(worker) == least
    monkeypatch.setattr(env_module, "_agent_argv", lambda _: ["/usr/bin/python", "train.py"])
    assert env_module.min_nodes(worker) is None
