"""elastictrain.train.parallel: a model laid out in a way the runner was not told about is refused before
anything is written; FSDP and HSDP are not. (One process: every mesh dimension has size 1, and the
placements are what they would be at any size.)"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastictrain.errors import ConfigError, exit_code
from elastictrain.mesh import MeshShape
from elastictrain.train import parallel


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _tensor_parallel(model: nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def test_tensor_parallelism_over_the_runners_mesh_is_refused_with_exit_2(one_rank):
    """The issue's case: Task.shard applies tensor parallelism over the mesh it is given; the
    runner would feed both ranks of the pair different samples."""
    model = _model()
    with pytest.raises(ConfigError, match=r"'0\.weight'.*no fully_shard manages it") as caught:
        parallel.shard(model, _tensor_parallel, torch.device("cpu"), 1)
    assert exit_code(caught.value) == 2
    assert "tensor (or another model) parallelism" in str(caught.value)
    assert "--mesh tp=N" in str(caught.value)  # the fix: declare it


def test_a_tensor_parallel_mesh_without_a_task_shard_is_refused_before_any_mesh_is_built():
    with pytest.raises(ConfigError, match=r"--mesh tp=2 needs a Task.shard") as caught:
        parallel.shard(_model(), None, torch.device("cpu"), MeshShape(dp_shard=2, tp=2))
    assert exit_code(caught.value) == 2


def test_tensor_parallelism_under_fsdp_on_a_2d_mesh_is_refused(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def shard(model, mesh):
        mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, mesh2d["tp"])
        fully_shard(model, mesh=mesh2d["dp"])

    with pytest.raises(ConfigError, match="it is sharded twice"):
        parallel.shard(_model(), shard, torch.device("cpu"), 1)


def test_a_ddp_model_with_tensor_parallel_parameters_is_refused(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    _tensor_parallel(model, init_device_mesh("cpu", (1,)))
    with pytest.raises(ConfigError, match="no fully_shard manages it"):
        parallel.for_setting("ddp").place(model, None, torch.device("cpu"), 1)
    parallel.for_setting("ddp").place(_model(), None, torch.device("cpu"), 1)  # plain: fine


def test_fsdp_by_default_by_the_task_and_hsdp_over_a_2d_mesh_are_accepted(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    parallel.shard(_model(), None, torch.device("cpu"), 1)
    parallel.shard(_model(), lambda m, mesh: fully_shard(m, mesh=mesh), torch.device("cpu"), 1)

    def hsdp(model, mesh):
        mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh2d)

    parallel.shard(_model(), hsdp, torch.device("cpu"), 1)


def _bucket_order(net) -> list[int]:
    """The parameters' positions (in ``net.module.parameters()``), bucket by bucket, in the order
    DDP reduces them: past two ranks, gloo's summation order."""
    position = {id(p): i for i, p in enumerate(net.module.parameters())}
    grad_buckets = net.reducer._get_zeros_like_grad_buckets()
    return [position[id(p)] for bucket in grad_buckets for p in bucket.parameters()]


def _backward(net) -> None:
    torch.manual_seed(1)
    net(torch.randn(5, 4)).sum().backward()
    for p in net.parameters():
        p.grad = None


def test_a_spares_primed_wrapper_moves_to_the_epochs_group_with_a_primed_runs_bucket_order():
    """In place (DDP): a spare primes its wrapper on a group of itself before any epoch exists;
    its first epoch only moves it (``_update_process_group``). Its buckets must be in the order a
    wrapper primed with every rank has, not a new wrapper's: with more than two ranks that order
    is the order gloo sums in, and the redone step would not be bitwise otherwise. A kept wrapper
    is moved, not rebuilt, at the next epoch, and trains there."""
    torch.manual_seed(0)
    reference, spares = _model(), _model()
    spares.load_state_dict(reference.state_dict())

    replica = parallel.KeptReplica()
    replica.prime_as_spare(spares, torch.device("cpu"), _backward)  # its own group, destroyed
    assert replica.primed and not dist.is_initialized()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # an epoch
    try:
        primed = parallel.wrap_ddp(reference, torch.device("cpu"), None)
        new_order = _bucket_order(primed)
        _backward(primed)
        primed(torch.zeros(1, 4))  # DDP rebuilds its buckets as the next forward starts
        assert _bucket_order(primed) != new_order  # else this test could not tell them apart

        net = replica.wrap(spares, torch.device("cpu"), None)
        assert net is replica.net and net.process_group is dist.group.WORLD
        assert _bucket_order(net) == _bucket_order(primed)
        for moved in (net, replica.wrap(spares, torch.device("cpu"), None)):  # the next epoch
            assert moved is net and not replica.alone
            torch.manual_seed(2)
            x = torch.randn(3, 4)
            moved(x).sum().backward()
            primed(x).sum().backward()
            for a, b in zip(spares.parameters(), reference.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad)
                a.grad, b.grad = None, None
        # The wrappers' reducers hold the group: they go while it lives (test_loop's
        # accumulation test says why: a reducer with a gloo group's last reference can hang).
        del replica, net, moved, primed, spares, reference
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_a_replacement_without_a_primed_wrapper_primes_one_alone_then_joins_the_epoch(one_rank):
    """Once called (on CUDA, a stream, a model-parallel task): a new wrapper on a group of this
    process alone, primed there, then moved to the epoch's group, the lone group destroyed."""
    torch.manual_seed(0)
    model = _model()
    replica = parallel.KeptReplica()
    net = replica.wrap(model, torch.device("cpu"), None)
    assert replica.alone and net.process_group is not dist.group.WORLD
    new_order = _bucket_order(net)
    replica.prime_alone(_backward)
    assert replica.primed and not replica.alone and net.process_group is dist.group.WORLD
    assert _bucket_order(net) != new_order  # rebuilt: a primed wrapper's order


def test_a_spare_whose_priming_fails_still_stands_in_and_says_why(caplog):
    """Priming ahead is an optimization: a task whose loss cannot run in a spare's world of one
    (here it raises) leaves the spare unprimed, with no group left behind, and a WARNING; the
    replacement then primes once called."""
    from torch.utils.data import TensorDataset

    from elastictrain.config import RunConfig
    from elastictrain.mesh import data_ranks
    from elastictrain.task import Task
    from elastictrain.train import runner
    from elastictrain.train.data import GlobalBatchSampler

    def loss_fn(model, batch):
        raise RuntimeError("needs the whole world")

    task = Task(
        model=_model(),
        dataset=TensorDataset(torch.randn(8, 4)),
        batch_size=4,
        make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=loss_fn,
    )
    cfg, replica = RunConfig(replace_in_place=True), parallel.KeptReplica()
    sampler = GlobalBatchSampler(8, 4, cfg.seed)
    runner._warm(cfg, task, sampler, torch.device("cpu"), data_ranks(None, 0, 1), replica)
    assert not replica.primed and replica.net is None and not dist.is_initialized()
    assert "priming DDP's buckets ahead failed (RuntimeError: needs the whole world)" in caplog.text
