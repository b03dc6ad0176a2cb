"""elastictrain.mesh: ``--mesh`` parsed and resolved against the world size, and each rank's
data-parallel coordinates (one tensor-parallel group, one share of the samples)."""

from __future__ import annotations

import pytest

from elastictrain import mesh
from elastictrain.config import RunConfig
from elastictrain.errors import ConfigError, exit_code
from elastictrain.mesh import DataRanks, MeshShape


def test_defaults_fsdp_over_every_rank_and_hsdp_one_replica_per_node():
    assert mesh.resolve("ddp", None, 8, 4) is None
    assert mesh.resolve("fsdp", None, 8, 4) == MeshShape(dp_shard=8)
    assert mesh.resolve("hsdp", None, 8, 4) == MeshShape(dp_replicate=2, dp_shard=4)
    assert mesh.resolve("fsdp", "tp=2", 8, 4) == MeshShape(dp_shard=4, tp=2)
    assert mesh.resolve("hsdp", "tp=2", 8, 4) == MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    assert mesh.resolve("fsdp", "dp_replicate=-1,dp_shard=2", 8, 4) == MeshShape(4, 2, 1)
    # The rest is what keeps a mesh elastic: a lost node takes a replica away.
    assert mesh.resolve("hsdp", "tp=2", 4, 4) == MeshShape(dp_replicate=1, dp_shard=2, tp=2)


@pytest.mark.parametrize(
    ("parallel", "spec", "words"),
    [
        ("fsdp", "dp_shard=3", "world size 8"),
        ("fsdp", "tp=3", "world size 8"),
        ("hsdp", "tp=3", "does not divide its 4 ranks"),
        ("ddp", "tp=2", "needs --parallel fsdp or hsdp"),
        ("fsdp", "pp=2", r"\(pipeline parallelism\) is not supported yet"),
        ("fsdp", "cp=2", r"\(context parallelism\) is not supported yet"),
        ("fsdp", "dp=2", "not DIM=N"),
        ("fsdp", "tp=0", "whole number >= 1"),
        ("fsdp", "tp=x", "whole number >= 1"),
        ("fsdp", "tp=2,tp=2", "given twice"),
        ("fsdp", "dp_shard=-1,tp=-1", "at most one"),
    ],
)
def test_a_mesh_that_cannot_be_built_is_a_config_error_naming_it(parallel, spec, words):
    with pytest.raises(ConfigError, match=words) as caught:
        mesh.resolve(parallel, spec, 8, 4)
    assert exit_code(caught.value) == 2


def test_the_syntax_is_checked_with_the_other_flags():
    with pytest.raises(ConfigError, match="not DIM=N"):
        RunConfig(parallel="fsdp", mesh="dp=2")
    assert RunConfig(parallel="fsdp", mesh="tp=2").mesh == "tp=2"


def test_tensor_parallel_ranks_share_their_data_parallel_rank():
    shape = MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    seen = [shape.data(r) for r in range(8)]
    assert [d.rank for d in seen] == [0, 0, 1, 1, 2, 2, 3, 3]  # tp innermost
    assert {d.size for d in seen} == {4}
    assert [d.leader for d in seen] == [True, False] * 4  # one ledger per group
    assert mesh.data_ranks(None, 5, 8) == DataRanks(5, 8, True)  # DDP: every rank its own
    assert shape.present() == ("dp_replicate", "dp_shard", "tp")
    assert MeshShape(dp_shard=8).present() == ("dp_shard",)
