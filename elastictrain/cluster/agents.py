"""torchrun's agents, as the workers see them through the rendezvous store.

- **A node lost while the job starts** (:class:`StartWatch`). Until the workers have formed
  their groups, a node whose agent dies (the node lost, killed with its workers) leaves the
  others waiting for its ranks in the handshake until ``--init-timeout`` (900 s): a rank that
  never started is absent, not silent, so heartbeats cannot tell. torchrun's own keep-alive can:
  the surviving agents remove a node whose agent stopped keeping alive from the round's
  participants (``keep_alive_interval`` x ``keep_alive_max_attempt``: 15 s by default). While a
  worker starts, its liveness probe reads the round's state each beat; a round that lost a
  participant ends the worker (exit 8), so torchrun re-forms the group without the node.
- **After a node left in place** (:func:`arrive_for_gone_nodes`): its agent never reaches the
  agents' exit barrier.

Once its workers finish, each torchrun agent waits for every agent of its rendezvous round
(``SimpleElasticAgent._exit_barrier``: ``store_util.barrier`` over ``GROUP_WORLD_SIZE`` agents,
300 s, no flag). A node dropped in place (lost, frozen, evicted: ``inplace``) had its agent
counted in that round and never arrives, so a job that finished would sit in the barrier for
5 minutes and then exit. The job's rank 0, at the end, arrives once for each agent whose node is
no longer in the job, on the same keys (torch 2.13's: the round's ``PrefixStore`` of the c10d
rendezvous store, and ``torchelastic/agent/terminal_state``).
"""

from __future__ import annotations

import logging
import os
import pickle
from base64 import b64decode
from typing import TYPE_CHECKING

from elastictrain.cluster.env import DistEnv, rendezvous_store

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

# torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID, store_util's suffixes
_BARRIER = "torchelastic/agent/terminal_state"


def _agents_store(store: dist.Store) -> dist.Store:
    """The rendezvous store itself: the workers' keys live under their run's prefix."""
    import torch.distributed as dist

    return store._underlying_non_prefix_store if isinstance(store, dist.PrefixStore) else store


def _round_state(store: dist.Store, run_id: str):
    """torchrun's rendezvous state (round, participants), which the c10d backend keeps
    base64-pickled under its run's key (torch's own agents wrote it; the workers already trust
    this store with everything)."""
    return pickle.loads(b64decode(store.get(f"torch.rendezvous.{run_id}")))


class StartWatch:
    """While this worker starts: whether a node of its torchrun round was lost (see the module's
    doc)."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self._round: int | None = None

    def lost(self, store: dist.Store) -> str | None:
        """Why this start cannot complete, or None. One request of ``store`` (torchrun's c10d
        rendezvous store; a connection of the asker's own: the handshake's blocks its own)."""
        state = _round_state(_agents_store(store), self.env.run_id)
        if self._round is None:
            self._round = state.round
        if state.round != self._round:
            return None  # a new round: this rank's agent restarts it anyway
        left = len(state.participants)
        if left >= self.env.group_world_size:
            return None
        return (
            f"{self.env.group_world_size - left} of the {self.env.group_world_size} nodes of "
            f"torchrun's rendezvous round {state.round} stopped keeping it alive while the job "
            "started (torchrun's agents removed them): their ranks will never join"
        )


def hosts_the_store(env: DistEnv) -> bool:
    """Whether this worker's torchrun agent serves the job's c10d rendezvous store (it listens on
    its port: ``/proc/net/tcp*`` against the agent's sockets). Such a node must never be taken
    out on purpose: the store, and with it every survivor's way back, would go with it."""
    address = rendezvous_store(env)
    if address is None or env.agent_pid is None:
        return False
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == address.port:  # LISTEN
                listening.add(f"socket:[{cols[9]}]")
    try:
        fds = os.listdir(f"/proc/{env.agent_pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{env.agent_pid}/fd/{fd}") in listening:
                return True
        except OSError:
            continue
    return False


def arrive_for_gone_nodes(env: DistEnv, store: dist.Store, nodes_left: int) -> int:
    """Rank 0, once training is over: arrive at the agents' exit barrier for each agent of the
    round (``env.group_world_size``) beyond ``nodes_left`` (the nodes still in the job; each
    one's agent arrives itself). ``store``: the job's, torchrun's c10d rendezvous store (its
    workers' prefix is left: the agents' keys are the store's own). How
    many arrivals it made (0 where no node left, or the store is not torchrun's c10d one)."""
    gone = env.group_world_size - nodes_left
    if gone <= 0 or rendezvous_store(env) is None:
        return 0
    store = _agents_store(store)
    state = _round_state(store, env.run_id)
    prefix = f"torch.rendezvous.{env.run_id}.{state.round}/{_BARRIER}"
    if store.add(f"{prefix}/num_members", gone) >= env.group_world_size:
        store.set(f"{prefix}/last_member", "<val_ignored>")
    logger.info(
        "%d node(s) left the job in place: arrived for their torchrun agents at the agents' exit "
        "barrier (round %d), so the others exit now instead of after its 300 s",
        gone,
        state.round,
    )
    return gone
