"""elastictrain.cluster.self_check: the checks a node runs before it trains, how every rank judges
the gathered findings, and whether the job goes on without a failing node."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastictrain import knobs
from elastictrain.cluster import self_check
from elastictrain.cluster.self_check import Findings, decide, judge


def _findings(nodes: int = 3, per_node: int = 2, **on_rank) -> list[Findings]:
    """Healthy findings of ``nodes`` x ``per_node`` ranks; ``on_rank={rank: {field: value}}``."""
    size, digest, exact, seconds = self_check.compute_check(torch.device("cpu"))
    out = []
    for rank in range(nodes * per_node):
        f = Findings(
            rank=rank,
            node=rank // per_node,
            host=f"h{rank // per_node}",
            serves_store=False,
            size=size,
            digest=digest,
            exact=exact,
            compute_s=seconds,
            store_rtt_s=0.001 if rank % per_node == 0 else None,
        )
        out.append(dataclasses.replace(f, **on_rank.get(f"r{rank}", {})))
    return out


def test_every_healthy_rank_computes_the_same_exact_product_and_a_flipped_bit_fails(monkeypatch):
    """The product of integer matrices is exact on any correct device: the same digest every
    time, and Freivalds' check passes. One flipped bit (``chaos unhealthy-node``) fails it."""
    cpu = torch.device("cpu")
    first, second = self_check.compute_check(cpu), self_check.compute_check(cpu)
    assert first[:3] == second[:3] and first[2] is True
    monkeypatch.setenv(knobs.UNHEALTHY, "compute")
    size, digest, exact, _ = self_check.compute_check(cpu)
    assert (size, exact) == (first[0], False) and digest != first[1]


def test_the_unhealthy_knob_can_name_the_ranks_it_applies_to(monkeypatch):
    monkeypatch.setenv(knobs.UNHEALTHY, "compute:1,3")
    monkeypatch.setenv("RANK", "3")
    assert knobs.unhealthy() == "compute"
    monkeypatch.setenv("RANK", "2")
    assert knobs.unhealthy() is None
    assert self_check.compute_check(torch.device("cpu"))[2] is True


def test_healthy_nodes_all_pass():
    assert judge(_findings(), rtt_limit_s=2.0) == {}


def test_a_wrong_product_fails_its_node_and_names_each_rank_and_host():
    failed = judge(_findings(r3={"exact": False, "digest": "bad"}), rtt_limit_s=2.0)
    assert list(failed) == [1]
    (reason,) = failed[1]
    assert "rank(s) 3 (host h1) is wrong" in reason and "computes wrong" in reason


def test_a_product_that_passes_freivalds_but_differs_from_the_others_fails_as_the_outlier():
    failed = judge(_findings(r4={"digest": "0123"}), rtt_limit_s=2.0)
    assert list(failed) == [2] and "differs from the product most ranks computed" in failed[2][0]


def test_a_slow_round_trip_to_the_store_fails_only_above_one_heartbeat():
    assert judge(_findings(r2={"store_rtt_s": 1.9}), rtt_limit_s=2.0) == {}
    failed = judge(_findings(r2={"store_rtt_s": 2.5}), rtt_limit_s=2.0)
    assert list(failed) == [1] and "takes 2.50s, more than one heartbeat (2s" in failed[1][0]


def test_a_node_short_of_tier_room_fails_only_where_other_nodes_have_it():
    """A full /dev/shm on one host is that node's fault; every node short of room is the
    state's size, and the tier turns itself off at its first copy instead."""
    room = {"tier_need": 3 << 30}
    full = {f"r{r}": {**room, "tier_free": 64 << 30} for r in (0, 2, 4)}
    full["r2"] = {**room, "tier_free": 1 << 30}
    failed = judge(_findings(**full), rtt_limit_s=2.0)
    assert list(failed) == [1] and "1024 MiB free and needs 3072 MiB" in failed[1][0]
    short = {f"r{r}": {**room, "tier_free": 1 << 30} for r in (0, 2, 4)}
    assert judge(_findings(**short), rtt_limit_s=2.0) == {}


def test_the_job_goes_on_without_a_failing_node_only_within_its_bounds():
    findings = _findings()
    failed = {1: ["bad"]}
    in_place = decide(failed, findings, in_place=True, floor=2)
    assert (in_place.how, in_place.ranks) == ("in place", [2, 3])
    assert decide(failed, findings, in_place=False, floor=2, restarts_left=1).how == "restart"
    below = decide(failed, findings, in_place=True, floor=3)
    assert below.how == "stop" and "leave 2 training node(s), below the minimum 3" in below.why_stop
    # A spare standing by takes the failed node's place: the job keeps its size.
    assert decide(failed, findings, in_place=True, floor=3, spares_ready=1).how == "in place"
    assert "no restart left" in decide(failed, findings, in_place=False, floor=1).why_stop
    store_node = _findings(r2={"serves_store": True})
    assert (
        "serves the job's rendezvous store"
        in decide(failed, store_node, in_place=True, floor=1).why_stop
    )
    assert decide(failed, findings, in_place=True, floor=1, movable=False).how == "stop"
    alone = _findings(nodes=1)
    assert decide({0: ["bad"]}, alone, in_place=True, floor=1).how == "stop"


def test_the_store_round_trip_is_measured_and_its_key_removed():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
    rtt = self_check.store_round_trip(server, "elastictrain/self-check/0")
    assert 0 < rtt < 1
    assert not server.check(["elastictrain/self-check/0"])


def test_two_ranks_that_both_take_themselves_for_a_nodes_first_never_share_a_key():
    """Ranks that play nodes on one host (each its node's local rank 0, one GROUP_RANK) once
    shared ``self-check/<node>``: one's delete left the other's blocking get waiting on a key no
    one set again, and the shard-tier probe hung in ``init_distributed`` (3 times in CI). Each
    rank's round trip now has a key of its own, set, read and removed by it alone."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
    touched: dict[int, set[str]] = {}

    class Recording:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def set(self, key, value):
            touched.setdefault(self.rank, set()).add(key)
            server.set(key, value)

        def get(self, key):
            return server.get(key)

        def delete_key(self, key):
            return server.delete_key(key)

    for rank in (0, 2):
        cpu = torch.device("cpu")
        self_check.examine(
            cpu, rank=rank, node=0, host="h", serves_store=False, store=Recording(rank)
        )
    assert touched[0].isdisjoint(touched[2]), touched
    assert not server.check([*touched[0], *touched[2]])


@pytest.mark.parametrize("flip", [False, True])
def test_a_spare_checks_its_compute_against_the_exact_product(monkeypatch, flip):
    if flip:
        monkeypatch.setenv(knobs.UNHEALTHY, "compute")
    why = self_check.spare_check(torch.device("cpu"), node=3)
    assert (why is not None) == flip
