"""elastictrain.cluster.agents: torchrun's rendezvous round as the workers read it (torch 2.13's
c10d backend keeps the state base64-pickled): a node lost while the job starts, and the exit
barrier a node that left in place never reaches."""

from __future__ import annotations

import pickle
from base64 import b64encode

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastictrain.cluster import agents
from elastictrain.cluster.env import read_env


def _publish(store: dist.Store, round_: int, nodes: int) -> None:
    state = _RendezvousState()
    state.round, state.complete = round_, True
    state.participants = {_NodeDesc(f"n{i}", 1, 1): i for i in range(nodes)}
    store.set("torch.rendezvous.job", b64encode(pickle.dumps(state)))


def _worker(group_world_size: int):
    return read_env(
        {
            "RANK": "0",
            "WORLD_SIZE": "4",
            "TORCHELASTIC_RUN_ID": "job",
            "GROUP_WORLD_SIZE": str(group_world_size),
        }
    )


def test_a_round_that_lost_a_node_while_starting_is_named_and_a_new_round_is_the_agents_to_handle():
    store = dist.HashStore()
    watch = agents.StartWatch(_worker(group_world_size=2))
    _publish(store, round_=3, nodes=2)
    assert watch.lost(dist.PrefixStore("elastictrain/run/job", store)) is None  # the workers' view
    _publish(store, round_=3, nodes=1)  # an agent stopped keeping alive: torchrun removed it
    said = watch.lost(store)
    assert said.startswith("1 of the 2 nodes of torchrun's rendezvous round 3 stopped keeping")
    _publish(store, round_=4, nodes=1)  # re-formed already: this rank's agent restarts it
    assert watch.lost(store) is None


def test_the_last_survivor_arrives_at_the_agents_exit_barrier_for_each_gone_node(monkeypatch):
    """torchrun's ``store_util.barrier`` keys, in the round's prefix: the surviving agent's own
    arrival then completes it. Nothing is done where no node left."""
    monkeypatch.setattr(agents, "rendezvous_store", lambda env: object())  # a c10d job
    store = dist.HashStore()
    _publish(store, round_=2, nodes=3)
    worker = _worker(group_world_size=3)
    assert agents.arrive_for_gone_nodes(worker, store, nodes_left=3) == 0
    prefix = "torch.rendezvous.job.2/torchelastic/agent/terminal_state"
    assert not store.check([f"{prefix}/num_members"])
    assert agents.arrive_for_gone_nodes(worker, store, nodes_left=1) == 2
    assert store.add(f"{prefix}/num_members", 0) == 2 and not store.check([f"{prefix}/last_member"])
    # The surviving agent's own arrival, as torch's barrier makes it:
    from torch.distributed.elastic.utils.store import barrier

    barrier(store, world_size=3, key_prefix=prefix, barrier_timeout=5)
