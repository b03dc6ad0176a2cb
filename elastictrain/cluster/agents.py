"""torchrun's agents, after a node left in place: its agent never reaches their exit barrier.

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
import pickle
from base64 import b64decode
from typing import TYPE_CHECKING

from elastictrain.cluster.env import DistEnv, rendezvous_store

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

# torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID, store_util's suffixes
_BARRIER = "torchelastic/agent/terminal_state"


def arrive_for_gone_nodes(env: DistEnv, store: dist.Store, nodes_left: int) -> int:
    """Rank 0, once training is over: arrive at the agents' exit barrier for each agent of the
    round (``env.group_world_size``) beyond ``nodes_left`` (the nodes still in the job; each
    one's agent arrives itself). ``store``: the job's, torchrun's c10d rendezvous store (its
    workers' prefix is left: the agents' keys are the store's own). How
    many arrivals it made (0 where no node left, or the store is not torchrun's c10d one)."""
    gone = env.group_world_size - nodes_left
    if gone <= 0 or rendezvous_store(env) is None:
        return 0
    import torch.distributed as dist

    if isinstance(store, dist.PrefixStore):  # the workers' keys live under their run's prefix
        store = store._underlying_non_prefix_store
    # The round's number is in the rendezvous state, which the c10d backend keeps base64-pickled
    # (torch's own agents wrote it; the workers already trust this store with everything).
    state = pickle.loads(b64decode(store.get(f"torch.rendezvous.{env.run_id}")))
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
