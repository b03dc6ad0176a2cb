"""elastictrain.inplace.eviction: which node a named straggler takes out of the job, and the
budgets that refuse it (never below --min-nodes, at most --max-evictions-per-hour, counted in
the job's store so that a new rank 0 reads the same count); every decision recorded."""

from __future__ import annotations

import torch.distributed as dist

from elastictrain.inplace.eviction import EvictionPolicy
from elastictrain.observe.stragglers import Straggler
from elastictrain.train.replicas import Suspect


class Events:
    def __init__(self) -> None:
        self.emitted: list[dict] = []

    def emit(self, event: str, **fields) -> None:
        self.emitted.append({"event": event, **fields})


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _slow(rank: int, slow: bool = True) -> Straggler:
    return Straggler(rank, "h", slow, 2.5, 0.25, 0.1, 3 if slow else 0)


# The epoch: 6 ranks on 3 nodes of 2; torchrun ranks 0-3 and 6-7 (node 2's first pair was lost).
MEMBERS, NODES, HOSTS = [0, 1, 2, 3, 6, 7], [0, 0, 1, 1, 3, 3], ["a", "a", "b", "b", "d", "d"]


def _decide(policy: EvictionPolicy, named, events: Events, **kw):
    return policy.decide(
        named, step=40, members=MEMBERS, nodes=NODES, hosts=HOSTS, events=events, **kw
    )


def test_a_named_straggler_takes_every_rank_of_its_node_out_and_the_decision_is_recorded():
    """By torchrun rank (the epoch's ranks are renumbered after a lost node) and with the
    evidence it was judged on; a rank that recovered is not acted on."""
    events = Events()
    policy = EvictionPolicy(min_nodes=1, per_hour=1, store=dist.HashStore(), run_id="r")
    assert _decide(policy, [_slow(2, slow=False)], events) is None and not events.emitted
    eviction = _decide(policy, [_slow(5)], events)
    assert (eviction.node, eviction.ranks, eviction.hosts, eviction.step) == (
        3,
        [6, 7],
        ["d"] * 2,
        40,
    )
    assert eviction.evidence == _slow(5).as_event()
    (said,) = events.emitted
    assert said["event"] == "eviction" and said["evicted"] and said["ranks"] == [6, 7]
    assert "node 3 (ranks [6, 7], host d) is a straggler: rank 5 took 2.50x" in eviction.describe()


def test_the_budgets_refuse_an_eviction_and_say_why_a_new_rank_0_reads_the_same_count():
    """Never below --min-nodes; at most --max-evictions-per-hour, counted in the job's store
    (a new rank 0, after rank 0's own node left, is a new policy on the same store). Seen
    failing with each check taken out."""
    store, clock, events = dist.HashStore(), Clock(), Events()
    floor = EvictionPolicy(min_nodes=3, per_hour=5, store=store, run_id="r", clock=clock)
    assert _decide(floor, [_slow(0)], events) is None
    assert events.emitted[-1]["refused"] == "it would leave 2 node(s), below --min-nodes 3"
    assert not events.emitted[-1]["evicted"]

    first = EvictionPolicy(min_nodes=1, per_hour=1, store=store, run_id="r", clock=clock)
    assert _decide(first, [_slow(0)], events).node == 0
    clock.now += 1800
    again = EvictionPolicy(min_nodes=1, per_hour=1, store=store, run_id="r", clock=clock)
    assert _decide(again, [_slow(2)], events) is None
    assert (
        "1 eviction(s) in the last hour already (--max-evictions-per-hour 1)"
        in (events.emitted[-1]["refused"])
    )
    other_job = EvictionPolicy(min_nodes=1, per_hour=1, store=store, run_id="other", clock=clock)
    assert _decide(other_job, [_slow(2)], events).node == 1  # its own history
    clock.now += 1801  # an hour after the first: the budget is back
    assert _decide(again, [_slow(2)], events).ranks == [2, 3]


def test_state_that_cannot_move_in_place_is_never_evicted():
    events = Events()
    policy = EvictionPolicy(min_nodes=1, per_hour=9, store=None, run_id="r")
    assert _decide(policy, [_slow(0)], events, movable=False) is None
    assert (
        events.emitted[-1]["refused"] == "the data stream's per-rank positions cannot move in place"
    )


def test_the_node_serving_the_jobs_store_is_never_evicted():
    """Its torchrun agent hosts the c10d rendezvous store: evicting it (its agent stopped) would
    take the store every survivor regroups through, and the job with it. (Seen on the two-node
    recipe, where the rendezvous gives that node either rank.)"""
    events = Events()
    policy = EvictionPolicy(min_nodes=1, per_hour=9, store=None, run_id="r")
    assert _decide(policy, [_slow(1)], events, store_nodes=[0]) is None
    assert "serves the job's rendezvous store" in events.emitted[-1]["refused"]
    assert _decide(policy, [_slow(2)], events, store_nodes=[0]).node == 1


def test_replace_needs_a_spare_standing_by_and_a_spare_keeps_the_node_count():
    """``replace`` never shrinks the job: with no spare node standing by it is refused (and
    recorded). With one, an eviction leaves the training nodes as many as before, so the floor
    that refused a shrink lets it through. Seen failing with each rule taken out."""
    events = Events()
    alone = EvictionPolicy(min_nodes=1, per_hour=5, store=None, run_id="r", action="replace")
    assert _decide(alone, [_slow(0)], events) is None
    assert "no spare node stands by" in events.emitted[-1]["refused"]
    spared = EvictionPolicy(
        min_nodes=3, per_hour=5, store=None, run_id="r", action="replace", spares=1
    )
    eviction = _decide(spared, [_slow(0)], events)
    assert eviction is not None and (eviction.action, eviction.spares) == ("replace", 1)
    assert events.emitted[-1]["evicted"] and events.emitted[-1]["action"] == "replace"
    assert "(--straggler-action replace), a spare node takes its ranks" in eviction.describe()
    shrink = EvictionPolicy(min_nodes=3, per_hour=5, store=None, run_id="r", spares=0)
    assert _decide(shrink, [_slow(0)], events) is None  # evict, no spare: below the floor


def test_a_refused_straggler_is_decided_again_each_report_and_its_refusal_recorded_once():
    """A straggler stands until it recovers, so the runner asks again at each report: no spare
    stood by when it was named (a spare still importing), one does now, and it is replaced then.
    The refusal is recorded once while its reason holds, not at every report. (Seen failing with
    ``said`` ignored: three refusals recorded.)"""
    events, said = Events(), {}
    waiting = EvictionPolicy(min_nodes=1, per_hour=5, store=None, run_id="r", action="replace")
    for _ in range(3):
        assert _decide(waiting, [_slow(0)], events, said=said) is None
    assert [e["evicted"] for e in events.emitted] == [False]
    ready = EvictionPolicy(
        min_nodes=1, per_hour=5, store=None, run_id="r", action="replace", spares=1
    )
    assert _decide(ready, [_slow(0)], events, said=said).ranks == [0, 1]
    assert [e["evicted"] for e in events.emitted] == [False, True]


def test_a_replica_that_computed_wrong_takes_its_node_out_on_the_same_budgets():
    """``train.replicas.Suspect``: the node of a rank outside a strict majority of its twins
    leaves as a straggler's would, and the message says why; below --min-nodes it is refused."""
    events = Events()
    suspect = Suspect(rank=3, host="b", step=50, agreed_at=40, twins=6)
    policy = EvictionPolicy(min_nodes=1, per_hour=1, store=dist.HashStore(), run_id="r")
    eviction = _decide(policy, [suspect], events, decided_by="replicas compared,")
    assert (eviction.node, eviction.ranks, eviction.evidence) == (1, [2, 3], suspect.as_event())
    assert eviction.describe().startswith(
        "node 1 (ranks [2, 3], host b) computed wrong: rank 3's parameters differed from a "
        "strict majority of its 6 twins at step 50 (all agreed at step 40); evicted at step 40 "
        "(replicas compared, evict)"
    )
    assert (
        events.emitted[-1]["cause"].startswith("computed wrong") and events.emitted[-1]["evicted"]
    )
    full = EvictionPolicy(min_nodes=3, per_hour=1, store=dist.HashStore(), run_id="r")
    assert _decide(full, [suspect], events) is None
    assert "below --min-nodes 3" in events.emitted[-1]["refused"]
