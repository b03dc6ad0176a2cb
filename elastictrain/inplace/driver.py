"""The one sequence that moves a process through its membership epochs (``states``), for the runner
and library mode alike: find the members, build the groups, liveness and the end's watch, agree
how the epoch began, resume, train, and on a peer's loss leave with the state and begin again.

What the driver needs is passed in (:class:`EpochSettings`, the hooks liveness reports from, the
:class:`Steps` that touch processes and the job's store); it holds the epoch it is in
(:class:`Epoch`), and nothing global does. Every transition becomes one ``epoch_state`` event:
kept until the epoch's event log is attached (:meth:`EpochDriver.attach`), since the first ones
happen before any checkpoint session exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.cluster.agents import arrive_for_gone_nodes
from elastictrain.cluster.env import DistEnv
from elastictrain.cluster.groups import ProcessGroups, init_process_groups, shutdown
from elastictrain.cluster.liveness import Liveness
from elastictrain.inplace import agreement, members, spares, supervisor
from elastictrain.inplace.epoch import Epoch, EpochSettings
from elastictrain.inplace.epoch_end import EpochEnd, prepare_nccl
from elastictrain.inplace.members import LiveState
from elastictrain.inplace.states import EpochState, EpochStates, Transition
from elastictrain.observe.events import Event

logger = logging.getLogger(__name__)

S = EpochState


@dataclass
class Steps:
    """What the driver does to processes and the job's store; the unit tests give fakes (an
    in-memory store, members in threads)."""

    next_members: Callable[..., list[int]] = members.next_members
    build_groups: Callable[..., ProcessGroups] = init_process_groups
    store_port: Callable[[DistEnv], int] = members.store_port
    agree: Callable[..., agreement.EpochStart] = agreement.agree
    shutdown: Callable[[], None] = shutdown
    arrive_for_gone_nodes: Callable[..., int] = arrive_for_gone_nodes


class EpochDriver:
    """Moves this process through its membership epochs (``env``: torchrun's identity, fixed for
    the process). ``step``, ``phase``: what its beats carry (the runner's watchdog; library mode
    has the driver's own: :meth:`at` and the state); ``watchdog``: bounds the recovery phases.
    ``spare_nodes``: the job's hot-spare nodes (``--spare-nodes``), if any."""

    def __init__(
        self,
        env: DistEnv,
        device: torch.device,
        settings: EpochSettings,
        *,
        spare: bool = False,
        spare_nodes: spares.SpareNodes | None = None,
        watchdog: Any = None,
        step: Callable[[], int | None] | None = None,
        phase: Callable[[], str] | None = None,
        steps: Steps | None = None,
    ) -> None:
        self.env, self.device, self.settings = env, device, settings
        self.spare_nodes = spare_nodes if spare_nodes is not None and spare_nodes.count else None
        self._called: tuple[spares.Call, list[int]] | None = None  # a spare node's call, members
        self.watchdog = watchdog
        self.steps = steps or Steps()
        self.epoch: Epoch | None = None
        self.last_step: int | None = None
        self._step = step or (lambda: self.last_step)
        self._phase = phase or (lambda: self.states.state.value)
        self._events: Any = None
        self._last_words: Callable[[str, str], None] | None = None
        self._pending: list[Transition] = []
        self.states = EpochStates(S.SPARE if spare else S.GATHERING, record=self._record)

    @property
    def state(self) -> EpochState:
        return self.states.state

    # -- events ----------------------------------------------------------------------------------

    def attach(
        self,
        events: Any,
        last_words: Callable[[str, str], None] | None = None,
        watchdog: Any = None,
    ) -> None:
        """The epoch's event log (its session's; rank 0's writes), the process's last words and
        its hang watchdog (library mode's manager has them): the transitions so far are written
        now, the next ones as they happen."""
        self._events = events
        self._last_words = last_words or self._last_words
        self.watchdog = watchdog or self.watchdog
        pending, self._pending = self._pending, []
        for t in pending:
            self._record(t)

    def _record(self, t: Transition) -> None:
        if self._events is None:
            self._pending.append(t)
            return
        self._events.emit(Event.EPOCH_STATE, **t.fields())

    def _say_last_words(self, cause: str, detail: str) -> None:
        if self._last_words is not None:
            self._last_words(cause, detail)

    # -- the states ------------------------------------------------------------------------------

    def wait_as_spare(
        self,
        warm: Callable[[], None],
        log_level: int = logging.INFO,
        *,
        per_process: bool = True,
        standby: Callable[[], spares.Standby] | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> float | None:
        """spare -> gathering: ``warm`` (what a replacement's first epoch would pay), then wait
        to be told to go: by the supervisor (``per_process``: a dead training process's spare),
        then, on a spare node, by the decider of an epoch that lost a node (``standby``: this
        rank's place in the job's store, connected once it is needed; ``stop``: a stop signal,
        the agent gone). When the death it stands in for was seen, or None (done: the supervisor
        is gone or ended the wait; the spare node was dismissed or stopped)."""
        warm()
        died_at = None
        if per_process:
            logger.log(
                log_level,
                "spare for rank %d ready (pid %d): waiting to stand in",
                self.env.rank,
                os.getpid(),
            )
            died_at = supervisor.wait_for_go()
            if died_at is None:
                return died_at if self.go(died_at) else None
        if standby is not None:
            place, timeout_s = standby(), self.settings.replace_timeout
            self._called = place.stand_by(
                lambda nonce: members.decided(place.store, nonce, self.env.rank, timeout_s), stop
            )
            if self._called is None:
                self.states.to(S.DONE, "the spare node was dismissed (the job finished) or stopped")
                return None
            call = self._called[0]
            self.states.to(S.GATHERING, f"called to take rank {call.stands_for}'s place")
            return call.at
        return died_at if self.go(died_at) else None

    def go(self, died_at: float | None) -> bool:
        """A spare, its wait over: True to stand in for a death seen at ``died_at``."""
        if died_at is None:
            self.states.to(S.DONE, "the spare's wait was ended (its supervisor is gone or done)")
            return False
        self.states.to(S.GATHERING, "told to stand in for a dead rank")
        return True

    @contextlib.contextmanager
    def recovering(self, in_place: bool) -> Iterator[None]:
        """An in-place epoch's beginning, bounded by --replace-timeout (the watchdog's phase)."""
        if not in_place or self.watchdog is None:
            yield
            return
        with self.watchdog.phase(
            "in-place recovery", self.settings.replace_timeout, self.settings.replace_flag
        ):
            yield

    def form(self, carry: LiveState | None, died_at: float | None) -> Epoch | None:
        """gathering -> forming: this epoch's members, then its groups, liveness and end. None
        (and the state ``exit``) when the members went on without this rank."""
        env, s = self.env, self.settings
        previous = carry.nonce if carry is not None else None
        try:
            if self._called is not None and carry is None:  # a spare node's rank, called
                previous, found = self._called[0].nonce, self._called[1]
                self._called = None
            else:
                found = self.steps.next_members(
                    env,
                    carry,
                    died_at,
                    wait_s=s.replace_wait,
                    timeout_s=s.replace_timeout,
                    silent_s=s.silent_timeout,
                    beat_s=s.beat_s,
                    spares=self.spare_nodes,
                )
        except BaseException as e:
            self.fail(e)
            raise
        if env.rank not in found:
            self.states.to(S.EXIT, "the others went on without this rank (back too late)")
            return None
        self.states.to(S.FORMING, f"members {found}")
        try:
            self.epoch = self._build(found, carry, died_at, previous)
        except BaseException as e:
            self.fail(e)
            raise
        return self.epoch

    def _build(
        self,
        found: list[int],
        carry: LiveState | None,
        died_at: float | None,
        previous: str | None = None,
    ) -> Epoch:
        """``previous``: the failed epoch's nonce (an in-place epoch)."""
        s = self.settings
        in_place = carry is not None or died_at is not None
        here = dataclasses.replace(self.env, rank=found.index(self.env.rank), world_size=len(found))
        end: EpochEnd | None = None  # once the groups exist: all a silence heard may fail
        liveness = Liveness(
            here.rank,
            here.world_size,
            interval_s=s.beat_s,
            silent_s=s.silent_timeout,
            step=self._step,
            phase=self._phase,
            last_words=self._say_last_words,
            # The closure reads ``end`` when called: a silence heard before the groups exist
            # fails nothing, and one heard after this epoch closed fails nothing of the next.
            on_silent=(lambda reason: members.drop_silent(liveness, reason, end))
            if s.replace_in_place
            else None,
        )
        if s.replace_in_place and self.device.type == "cuda":
            prepare_nccl()
        groups = self.steps.build_groups(
            here,
            self.device,
            # In place, the wait is for a replacement that is already imported: short.
            init_timeout=s.replace_timeout if in_place else s.init_timeout,
            collective_timeout=s.collective_timeout,
            checkpoint_timeout=s.checkpoint_timeout,
            liveness=liveness,
            timeout_flag=s.replace_flag if in_place else s.init_flag,
            store_up=in_place,
        )
        if s.replace_in_place:
            end = EpochEnd(
                groups.attempt.nonce,
                self.steps.store_port(self.env),
                groups.connections,
                member=self.env.rank,
            )
            if groups.store is not None:
                if here.rank == 0:
                    members.publish(groups.store, groups.attempt.nonce, found)
                end.watch(groups.store)
        liveness.start()
        took = []
        if self.spare_nodes is not None and previous and groups.store is not None:
            took = members.took_over(groups.store, previous)
        return Epoch(here, found, groups, liveness, end, carry, died_at, took)

    def agree(self, group: Any, **agree_options: Any) -> agreement.EpochStart:
        """forming -> agreeing -> resuming: how the epoch began, agreed by every member over
        ``group`` (a recurring failure ends it here: ``RecurringFailureError``)."""
        epoch = self.epoch
        self.states.to(S.AGREEING, "groups built")
        try:
            start = self.steps.agree(
                epoch.carry,
                epoch.died_at,
                group=group,
                store=epoch.groups.store,
                rank=epoch.env.rank,
                members=epoch.members,
                dropped=epoch.dropped,
                took_over=epoch.took_over,
                **agree_options,
            )
        except BaseException as e:
            self.fail(e)
            raise
        began = start.start_fields().get("began", "fresh start")
        self.states.to(S.RESUMING, began, step=start.newest_step if start.in_place else None)
        return start

    def training(self, step: int) -> None:
        """resuming -> training, from ``step`` (completed steps the state holds)."""
        self.last_step = step
        self.states.to(S.TRAINING, "state loaded", step=step)

    def at(self, step: int) -> None:
        """Completed steps, for the beats (library mode; the runner's come from its watchdog)."""
        self.last_step = step

    def is_peer_loss(self, error: BaseException) -> bool:
        """Whether ``error`` ends this epoch by a peer's loss (``members.is_peer_loss``)."""
        if not self.settings.replace_in_place or self.epoch is None:
            return False
        return members.is_peer_loss(error, self.epoch.end)

    def leave(self, carry: LiveState, abandon: Callable[[], None] = lambda: None) -> None:
        """resuming|training -> leaving -> gathering: a peer is lost. This rank fails the
        epoch's collectives and counts itself back for the next one at once (``members.leave``),
        gives up what it began in the epoch (``abandon``: its checkpoint session), then tears
        the epoch down; ``carry`` (its state) goes into the next :meth:`form`."""
        epoch = self.epoch
        carry.nonce, carry.members = epoch.groups.attempt.nonce, epoch.members
        # Found silent, or left out on purpose (a node evicted): either way not waited for.
        found = members.silent_members(epoch.liveness, epoch.members, epoch.end)
        carry.silent = sorted(set(carry.silent) | set(found))
        self.states.to(S.LEAVING, carry.error or "a peer was lost", step=carry.step)
        members.leave(carry, epoch.groups.store, self.env.rank, epoch.end)
        abandon()
        self._events = None  # the session's log is closed: the next epoch's is attached anew
        self.close(wait=False)
        self.states.to(S.GATHERING, "counted back for the next epoch")

    def finish(
        self, step: int | None = None, reason: str = "finished", nodes: list[int] | None = None
    ) -> None:
        """training -> done (once), at ``step`` (completed steps). ``nodes``: rank 0's, each
        rank's node in the last epoch: the spare nodes standing by are dismissed (they exit 0),
        and torchrun's agents of the nodes no longer in the job (neither training nor standing
        by) are stood in for at their exit barrier (``cluster.agents``)."""
        self.last_step = step if step is not None else self.last_step
        if self.state == S.DONE:
            return
        self.states.to(S.DONE, reason, step=self.last_step)
        epoch = self.epoch
        if nodes and epoch is not None and epoch.env.is_rank0 and epoch.groups.store is not None:
            try:
                left = len(set(nodes))
                if self.spare_nodes is not None:  # the spares standing by exit, and are there
                    left += spares.dismiss(
                        epoch.groups.store,
                        self.spare_nodes,
                        answer_s=max(1.0, self.settings.replace_wait),
                    )
                self.steps.arrive_for_gone_nodes(self.env, epoch.groups.store, left)
            except Exception as e:  # the agents then wait their 300 s: slower, nothing lost
                logger.warning(
                    "could not arrive for the gone nodes' agents at torchrun's exit barrier "
                    "(%s: %s); the other agents wait for them up to 300 s",
                    type(e).__name__,
                    e,
                )

    def fail(self, error: BaseException | str) -> None:
        """-> exit: the process ends with ``error`` (once; a state already final stays)."""
        if self.state in (S.DONE, S.EXIT):
            return
        reason = error if isinstance(error, str) else members.error_line(error)
        self.states.to(S.EXIT, reason, step=self.last_step)

    def close(self, wait: bool = True) -> None:
        """Tear the epoch down: its end closed first (from now on nothing fails its collectives,
        whatever a late silence or announcement says), its beats stopped (``wait=False``: not
        for a beat thread that may be inside a store request: a peer was lost), its groups
        destroyed (after an NCCL abort there are none)."""
        epoch, self.epoch = self.epoch, None
        if epoch is not None:
            if epoch.end is not None:
                epoch.end.close(wait=wait)
            epoch.liveness.stop(wait=wait)
        self.steps.shutdown()  # also what a failed forming left behind
