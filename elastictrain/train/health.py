"""Health decides who is in the job, while it trains: a straggler's node evicted or handed to a
spare node (``inplace.eviction``), and at a start the nodes' self-check (``cluster.self_check``),
a failing node left out. Rank 0 decides; every rank learns the decision in one broadcast, then
leaves the epoch the way a lost node's survivors do (``PeerLost``: the others regroup in place)
or, where the node is the one that goes, exits 9.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from elastictrain.cluster import self_check
from elastictrain.cluster.agents import hosts_the_store
from elastictrain.cluster.collectives import all_gather_object
from elastictrain.cluster.env import min_nodes
from elastictrain.errors import (
    NodeEvictedError,
    NodesLeftOutError,
    NodeUnhealthyError,
    SelfCheckFailedError,
)
from elastictrain.inplace import eviction, spares
from elastictrain.inplace.members import PeerLost
from elastictrain.observe import stragglers
from elastictrain.observe.events import Event
from elastictrain.train import replicas

if TYPE_CHECKING:
    from elastictrain.checkpoint.state import TrainState
    from elastictrain.inplace.driver import EpochDriver
    from elastictrain.inplace.members import LiveState
    from elastictrain.train.attempt import Attempt


class TrainingRun(Protocol):
    """What these decisions read of the training loop (``training._Run``)."""

    attempt: Attempt
    driver: EpochDriver
    state: TrainState
    completed: int
    standing: dict[int, stragglers.Straggler]
    """Rank 0: stragglers named and not recovered."""
    refused: dict[int, str]
    """Rank 0: each standing straggler's last refusal, recorded once while it holds."""

    def carry(self) -> LiveState: ...


logger = logging.getLogger(__name__)


def evict_if_decided(run: TrainingRun, step: int, named: list[stragglers.Straggler]) -> None:
    """``--straggler-action evict|replace``: rank 0's decision on what it just named, every
    rank's (``inplace.eviction``). The evicted node's ranks raise ``NodeEvictedError`` (exit
    9); the others leave the epoch with their state at ``step``, the evicted ranks not
    waited for, as after a lost node (a spare node standing by takes their places)."""
    attempt, driver = run.attempt, run.driver
    action = attempt.cfg.straggler_action
    if action == "report" or attempt.env.world_size == 1:
        return
    session, members = attempt.session, driver.epoch.members
    for s in named:  # standing until recovered: a refusal is decided again each report
        if s.slow:
            run.standing[s.rank] = s
        else:
            run.standing.pop(s.rank, None)
            run.refused.pop(s.rank, None)
    stragglers_now = list(run.standing.values())
    policy = _policy(run, action) if attempt.env.is_rank0 and stragglers_now else None
    decided = eviction.agree(
        policy,
        lambda p: p.decide(
            stragglers_now,
            step=step,
            members=members,
            nodes=session.nodes,
            hosts=session.hosts,
            events=attempt.events,
            movable=not run.state.per_rank,
            store_nodes=session.store_nodes,
            said=run.refused,
        ),
        attempt.groups.control,
    )
    if decided is not None:
        _leave(run, step, decided)


def leave_out_suspects(run: TrainingRun, step: int, suspects: list[replicas.Suspect]) -> None:
    """Every rank, once a replica mismatch was rolled back to ``step`` (``train.replicas``):
    under ``--replace-in-place`` the suspects' nodes leave as an evicted straggler's does, a
    spare node standing by taking their ranks (within ``--min-nodes`` and
    ``--max-evictions-per-hour``). Without suspects (two twins: no majority) every node runs its
    exact compute check, and one whose device computes wrong now leaves (``check_nodes``)."""
    attempt = run.attempt
    if not attempt.cfg.replace_in_place or attempt.env.world_size == 1:
        return  # named only: the same suspect again stops the job (``replicas``)
    if not suspects:  # --no-self-check skips the start's check, not this one
        check_nodes(run, compute_only=True)
        return
    policy = None
    if attempt.env.is_rank0:
        policy = _policy(run, "replace" if _spares_ready(run) else "evict")
    decided = eviction.agree(
        policy,
        lambda p: p.decide(
            suspects,
            step=step,
            members=run.driver.epoch.members,
            nodes=attempt.session.nodes,
            hosts=attempt.session.hosts,
            events=attempt.events,
            movable=not run.state.per_rank,
            store_nodes=attempt.session.store_nodes,
            decided_by="replicas compared,",
        ),
        attempt.groups.control,
    )
    if decided is not None:
        _leave(run, step, decided)


def _spares_ready(run: TrainingRun) -> int:
    """Rank 0: the spare nodes standing by now."""
    driver = run.driver
    store, spare_nodes = driver.epoch.groups.store, driver.spare_nodes
    return spares.standing_by(store, spare_nodes) if spare_nodes and store else 0


def _policy(run: TrainingRun, action: str) -> eviction.EvictionPolicy:
    """Rank 0's eviction budgets (``inplace.eviction``), with the spares standing by now."""
    driver = run.driver
    return eviction.EvictionPolicy(
        min_nodes=node_floor(run),
        per_hour=run.attempt.cfg.max_evictions_per_hour,
        store=driver.epoch.groups.store,
        run_id=driver.env.run_id,
        action=action,
        spares=_spares_ready(run),
    )


def _leave(run: TrainingRun, step: int, decided: eviction.Eviction) -> None:
    """Every rank, on an eviction: the evicted node's ranks raise ``NodeEvictedError`` (exit
    9); the others leave the epoch with their state at ``step``, the evicted ranks not waited
    for, as after a lost node (a spare node standing by takes their places)."""
    _all_heard(run, step, decided.ranks)
    if run.driver.env.rank in decided.ranks:
        raise NodeEvictedError(decided.describe())
    carry = run.carry()
    carry.silent = decided.ranks
    raise PeerLost(carry, NodeEvictedError(decided.describe()))


def _all_heard(run: TrainingRun, step: int, evicted: list[int]) -> None:
    """Every rank counts itself in the job's store once it has the decision; an evicted rank
    leaves only when all have (at most 10 s). Its exit closes its gloo connections, and a
    node-mate still finishing the decision's broadcast (or a collective before it) would read
    that as a death and take itself for a survivor: seen once under load, an epoch of 3 ranks
    after a 2x2 HSDP eviction. The store is not a gloo pair: nobody reads a closed one."""
    driver = run.driver
    store = driver.epoch.groups.store
    if store is None:
        return
    key = f"elastictrain/eviction-heard/{run.attempt.session.generation}/{step}"
    heard = store.add(key, 1)
    deadline = time.monotonic() + 10.0
    while driver.env.rank in evicted and heard < driver.env.world_size:
        if time.monotonic() > deadline:
            return  # a peer that never hears it is lost anyway: leave
        time.sleep(0.01)
        heard = store.add(key, 0)


def node_floor(run: TrainingRun) -> int:
    """The fewest training nodes the job may go on with: ``--min-nodes``, else torchrun's
    MIN less the spare nodes, else 1."""
    floor, spare_nodes = min_nodes(run.driver.env), run.driver.spare_nodes
    floor = floor - spare_nodes.count if floor and spare_nodes else floor
    return run.attempt.cfg.min_nodes or max(1, floor or 1)


def check_nodes(run: TrainingRun, *, compute_only: bool = False) -> None:
    """At a start: every node's self-check (``cluster.self_check``). A failing node leaves
    (its ranks raise ``NodeUnhealthyError``, exit 9) and the others go on without it: in
    place as after an eviction, else through torchrun's re-rendezvous; or every rank stops
    (exit 2) when the job cannot go on without it. ``compute_only``: the exact compute check
    alone, after two twins differed (``leave_out_suspects``): mid-run, the store's round trip
    and the tier's room (its own copies fill it) say nothing about who computed wrong."""
    attempt, driver, env = run.attempt, run.driver, run.attempt.env
    node_rank0 = env.local_rank == 0 and not compute_only
    mine = self_check.examine(
        attempt.device,
        rank=env.rank,
        node=env.node_rank,
        host=socket.gethostname(),
        serves_store=env.local_rank == 0 and hosts_the_store(driver.env),
        store=driver.epoch.groups.store if node_rank0 else None,
        room=None if compute_only else lambda: attempt.session.tier_room(run.state, run.completed),
    )
    findings = all_gather_object(mine, attempt.groups.control)
    failed = self_check.judge(findings, rtt_limit_s=attempt.cfg.heartbeat_seconds)
    if not failed:
        if env.is_rank0:
            logger.info(
                "self-check: %d node(s) passed (compute %.0f ms at most, store round trip "
                "%.1f ms at most)",
                len({f.node for f in findings}),
                1e3 * max(f.compute_s for f in findings),
                1e3 * max((f.store_rtt_s or 0.0) for f in findings),
            )
        return
    box = [_decide_left_out(run, failed, findings) if env.is_rank0 else None]
    dist.broadcast_object_list(box, src=0, group=attempt.groups.control)
    left_out: self_check.LeftOut = box[0]
    message = left_out.describe()
    if left_out.how == "stop":
        skip = "" if compute_only else "; --no-self-check skips the check"
        raise SelfCheckFailedError(
            f"{message}. Fix or replace the node(s), or relaunch without them{skip}."
        )
    if env.rank not in left_out.ranks:
        if left_out.how == "restart":
            raise NodesLeftOutError(message)
        carry = run.carry()
        carry.silent = [driver.epoch.members[r] for r in left_out.ranks]
        raise PeerLost(carry, NodeUnhealthyError(message))
    if left_out.how == "restart" and node_rank0 and env.agent_pid:
        # Without a supervisor, this node's agent leaves by a signal: one that exits on its
        # own would close the job's rendezvous for the others (``inplace.eviction``).
        os.kill(env.agent_pid, signal.SIGTERM)
    raise NodeUnhealthyError(message)


def _decide_left_out(run: TrainingRun, failed, findings) -> self_check.LeftOut:
    """Rank 0: whether the job goes on without the failing nodes; recorded."""
    attempt, driver = run.attempt, run.driver
    store, spare_nodes = driver.epoch.groups.store, driver.spare_nodes
    in_place = attempt.cfg.replace_in_place
    ready = 0
    if in_place and spare_nodes and store is not None:  # spares still starting: wait
        deadline = time.monotonic() + attempt.cfg.replace_timeout
        while (ready := spares.standing_by(store, spare_nodes)) < min(
            len(failed), spare_nodes.count
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
    env = driver.env
    decided = self_check.decide(
        failed,
        findings,
        in_place=in_place,
        floor=node_floor(run),
        spares_ready=ready,
        movable=not run.state.per_rank,
        restarts_left=env.max_restarts - env.restart_count,
    )
    logger.error("SELF-CHECK: %s", decided.describe())
    attempt.events.emit(
        Event.SELF_CHECK,
        failed={str(n): why for n, why in failed.items()},
        ranks=decided.ranks,
        action=decided.how,
        why_stop=decided.why_stop,
        spares=ready,
        **self_check.summary([f for f in findings if f.node in failed]),
    )
    return decided
