"""elastictrain.inplace.driver without processes: members are threads, the job's store is a
``HashStore``, the process groups are fakes whose collectives meet in memory. The real pieces
run: the state machine, the handshake, who is back (``members``), the agreement and its
recurring-failure verdicts, the epoch's end. What needs real processes (gloo's resets, torchrun,
the supervisor) stays in tests/integration."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elastictrain.cluster.env import DistEnv
from elastictrain.cluster.groups import ProcessGroups
from elastictrain.cluster.handshake import handshake
from elastictrain.errors import InitTimeoutError, RecurringFailureError, StoreSilentError
from elastictrain.inplace import members
from elastictrain.inplace.driver import EpochDriver, Steps
from elastictrain.inplace.epoch import EpochSettings
from elastictrain.inplace.members import LiveState
from elastictrain.inplace.states import TRANSITIONS, EpochState, EpochStates, TransitionError

S = EpochState
SETTINGS = EpochSettings(
    replace_in_place=True,
    init_timeout=10,
    collective_timeout=10,
    checkpoint_timeout=10,
    replace_wait=0.5,
    replace_timeout=10,
    silent_timeout=0,  # liveness off: its own tests have fake clocks (test_liveness)
    beat_s=1.0,
)


class Hub:
    """Where the fake groups' collectives meet: every member's value, once all have come."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._slots: dict = {}

    def exchange(self, key, rank: int, world: int, value, timeout: float = 5.0) -> list:
        with self._cv:
            slot = self._slots.setdefault(key, {})
            slot[rank] = value
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: len(slot) == world, timeout):
                raise dist.DistError(f"a member of {key[0]} never came (a collective's timeout)")
            return [slot[r] for r in range(world)]


@dataclasses.dataclass
class FakeGroup:
    nonce: str
    rank: int
    world: int
    hub: Hub
    calls: int = 0

    def exchange(self, value) -> list:
        self.calls += 1
        return self.hub.exchange((self.nonce, self.calls), self.rank, self.world, value)


class Collectives:
    """``agreement``'s collectives over a :class:`FakeGroup`."""

    @staticmethod
    def all_gather_object(obj, group: FakeGroup) -> list:
        return group.exchange(obj)

    @staticmethod
    def broadcast_bytes(data, group: FakeGroup) -> bytes:
        return group.exchange(data)[0] or b""


class Job:
    """One job: its store, where the groups meet, and each member's transitions."""

    def __init__(self, world: int) -> None:
        self.world, self.store, self.hub = world, dist.HashStore(), Hub()
        self.fail_forming: set[int] = set()  # members whose forming fails (a death there)

    def env(self, rank: int) -> DistEnv:
        return DistEnv(
            rank=rank,
            world_size=self.world,
            local_rank=rank,
            local_world_size=self.world,
            master_addr="127.0.0.1",
            master_port=-1,
            restart_count=0,
            max_restarts=0,
            run_id="test",
            use_agent_store=True,
            launched_by_torchrun=True,
        )

    def build_groups(
        self, here: DistEnv, device, *, init_timeout, liveness, **_
    ) -> SimpleNamespace:
        if here.rank in self.fail_forming:
            raise InitTimeoutError(f"rank {here.rank}: a member died while the groups formed")
        attempt = handshake(self.store, here, init_timeout)
        group = FakeGroup(attempt.nonce, here.rank, here.world_size, self.hub)
        return ProcessGroups(attempt=attempt, control=group, store=self.store)

    def driver(self, rank: int, *, spare: bool = False, settings=SETTINGS) -> EpochDriver:
        steps = Steps(
            next_members=functools.partial(members.next_members, store=self.store),
            build_groups=self.build_groups,
            store_port=lambda env: -1,
            agree=functools.partial(_agree, collectives=Collectives),
            shutdown=lambda: None,
        )
        return EpochDriver(self.env(rank), torch.device("cpu"), settings, spare=spare, steps=steps)


def _agree(*args, collectives, **kwargs):
    from elastictrain.inplace import agreement

    return agreement.agree(*args, collectives=collectives, **kwargs)


def _together(*calls, timeout: float = 20.0) -> list:
    """Run each call in a thread of its own (a member); their results, or their errors."""
    out: list = [None] * len(calls)

    def one(i, call):
        try:
            out[i] = call()
        except BaseException as e:  # noqa: BLE001 (a member's error is its result here)
            out[i] = e

    threads = [threading.Thread(target=one, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a member never finished"
    return out


def _begin(d: EpochDriver, carry=None, died_at=None, step: int = 0):
    """What the runner and library mode do as an epoch begins: form, agree, resume."""
    epoch = d.form(carry, died_at)
    if epoch is None:
        return None
    start = d.agree(epoch.groups.control)
    d.training(start.newest_step if start.in_place else step)
    return start


def _states(d: EpochDriver) -> list[str]:
    return [t.state.value for t in d.states.history]


def _carry(step: int, error: str = "DistBackendError: Connection reset by peer") -> LiveState:
    return LiveState(step, {"step": step}, None, time.time(), error=error)


def test_every_transition_of_the_table_is_allowed_and_nothing_else():
    for source, targets in TRANSITIONS.items():
        for target in S:
            states = EpochStates(source)
            if target in targets:
                assert states.to(target, "why").state == target
            else:
                with pytest.raises(TransitionError, match=f"{source} -> {target}"):
                    states.to(target, "why")
    assert not TRANSITIONS[S.DONE] and not TRANSITIONS[S.EXIT]  # final


def test_a_fresh_start_forms_agrees_and_trains_with_one_event_per_transition():
    """Every member goes gathering -> forming -> agreeing -> resuming -> training -> done; the
    transitions before the event log exists are written once it is attached, at their own
    times, each with its reason and the time spent in the state it left."""
    job = Job(3)
    drivers = [job.driver(r) for r in range(3)]
    starts = _together(*(functools.partial(_begin, d) for d in drivers))
    assert all(s.replaced == [] and not s.in_place for s in starts), starts
    events: list = []
    drivers[0].attach(SimpleNamespace(emit=lambda event, **f: events.append((event, f))))
    for d in drivers:
        d.finish()
    for d in drivers:
        assert _states(d) == ["gathering", "forming", "agreeing", "resuming", "training", "done"]
    assert [f["state"] for _, f in events] == _states(drivers[0])[1:]
    assert {e for e, _ in events} == {"epoch_state"}
    assert all(f["duration_s"] >= 0 and f["reason"] for _, f in events)
    times = [f["time"] for _, f in events]
    assert times == sorted(times) and times[-1] - times[0] < 10
    assert [d.epoch.env.rank for d in drivers] == [0, 1, 2]


def test_a_death_regroups_the_survivors_with_the_replacement_which_takes_the_newest_state():
    """Rank 1 dies at step 7 (rank 2 held step 6): the survivors leave with their state, the
    spare told to go joins, and the next epoch agrees who was replaced and who sends the state."""
    job = Job(3)
    first = [job.driver(r) for r in range(3)]
    _together(*(functools.partial(_begin, d) for d in first))
    survivors = {0: (first[0], _carry(7)), 2: (first[2], _carry(6))}
    spare = job.driver(1, spare=True)

    def survivor(r):
        d, carry = survivors[r]
        d.leave(carry)
        return _begin(d, carry)

    def replacement():
        time.sleep(0.2)  # its supervisor saw the death, then told it to go
        assert spare.go(died_at=time.time() - 0.5)
        return _begin(spare, died_at=time.time() - 0.5)

    got = _together(functools.partial(survivor, 0), replacement, functools.partial(survivor, 2))
    assert all(not isinstance(s, BaseException) for s in got), got
    assert {(s.replaced == [1], s.newest_step, s.source_rank) for s in got} == {(True, 7, 0)}
    assert got[0].start_fields()["began"] == "replaced in place"
    after = ["training", "leaving", "gathering", "forming", "agreeing", "resuming", "training"]
    assert _states(first[0])[4:] == after
    assert _states(spare)[:3] == ["spare", "gathering", "forming"]
    leaving = next(t for t in first[0].states.history if t.state == S.LEAVING)
    assert leaving.step == 7 and "Connection reset" in leaving.reason
    assert [d.epoch.members for d in (first[0], spare, first[2])] == [[0, 1, 2]] * 3


def test_a_replacement_later_than_the_wait_is_dropped_and_exits_while_the_others_go_on():
    """Rank 2's spare comes after the survivors' --replace-wait: they go on at two ranks (a node
    lost), and the late replacement learns it and exits (torchrun restarts the group)."""
    job = Job(3)
    first = [job.driver(r) for r in range(3)]
    _together(*(functools.partial(_begin, d) for d in first))
    late = job.driver(2, spare=True)

    def survive(r):
        carry = _carry(4)
        first[r].leave(carry)
        return _begin(first[r], carry)

    def replacement():
        time.sleep(SETTINGS.replace_wait + 1.0)
        late.go(died_at=time.time())
        return late.form(None, died_at=time.time())

    got = _together(functools.partial(survive, 0), functools.partial(survive, 1), replacement)
    assert got[2] is None and late.state == S.EXIT
    assert "went on without this rank" in late.states.history[-1].reason
    assert [s.newest_step for s in got[:2]] == [4, 4]
    assert [d.epoch.members for d in first[:2]] == [[0, 1], [0, 1]]
    assert got[0].start_fields()["began"] == "shrunk in place"


def test_a_second_death_while_forming_ends_the_member_that_saw_it_with_its_error():
    """Forming fails (a member died inside the new epoch's handshake: its groups time out): the
    member exits with the error named in its last transition, for torchrun's restart."""
    job = Job(2)
    first = [job.driver(r) for r in range(2)]
    _together(*(functools.partial(_begin, d) for d in first))
    job.fail_forming = {0}
    survivor = first[0]
    carry = _carry(3)
    survivor.leave(carry)
    first[1].leave(_carry(3))
    with pytest.raises(InitTimeoutError):
        survivor.form(carry, None)
    assert survivor.state == S.EXIT
    assert "died while the groups formed" in survivor.states.history[-1].reason


def test_a_death_that_recurs_at_the_same_step_ends_every_member_with_a_named_error():
    """Rank 1 dies at step 5, is replaced, and dies at step 5 again: the next agreement refuses
    to go on (RecurringFailureError on every member), and each driver ends in exit."""
    job = Job(2)
    drivers = [job.driver(r) for r in range(2)]
    _together(*(functools.partial(_begin, d) for d in drivers))
    for _ in range(2):
        spare = job.driver(1, spare=True)

        def survivor(d=drivers[0]):
            carry = _carry(5)
            d.leave(carry)
            return _begin(d, carry)

        def replacement(spare=spare):
            time.sleep(0.2)
            spare.go(died_at=time.time())
            return _begin(spare, died_at=time.time())

        got = _together(survivor, replacement)
    assert all(isinstance(g, RecurringFailureError) for g in got), got
    assert "rank 1's training process died twice at step 5" in str(got[0])
    assert drivers[0].state == S.EXIT and spare.state == S.EXIT


def test_a_frozen_member_is_not_waited_for_and_the_others_go_on_without_it():
    """Rank 2 froze (its beats stopped): the survivors leave naming it silent and regroup
    without waiting the --replace-wait out for it (a frozen host's processes never come back)."""
    job = Job(3)
    settings = dataclasses.replace(SETTINGS, replace_wait=30.0)
    first = [job.driver(r, settings=settings) for r in range(3)]
    _together(*(functools.partial(_begin, d) for d in first))
    for d in first[:2]:  # what liveness and the epoch's end tell each survivor
        d.epoch.end.silent = [2]

    def survivor(r):
        carry = _carry(9)
        first[r].leave(carry)
        assert carry.silent == [2]
        return _begin(first[r], carry)

    t0 = time.monotonic()
    got = _together(functools.partial(survivor, 0), functools.partial(survivor, 1))
    assert time.monotonic() - t0 < 10  # the 30 s wait was not spent on the frozen member
    assert [d.epoch.members for d in first[:2]] == [[0, 1], [0, 1]]
    assert [g.newest_step for g in got] == [9, 9]


def test_a_silent_store_ends_the_member_in_gathering_with_the_stores_error():
    """The job's store stops answering while the members are gathered: the driver exits with
    the store's error (liveness names the store and exits 8 in a real process)."""
    job = Job(2)

    def silent(*args, **kwargs):
        raise StoreSilentError("the job's store at 127.0.0.1:29500 did not answer within 15s")

    d = job.driver(0)
    d.steps.next_members = silent
    with pytest.raises(StoreSilentError):
        d.form(_carry(2), None)
    assert d.state == S.EXIT and "did not answer" in d.states.history[-1].reason


def test_an_error_with_every_member_back_is_refused_when_it_recurs_at_its_step():
    """A collective failed with every member alive (no peer lost: any DistError reads as a
    loss). Once at a step, the members regroup; again at that step, the agreement ends them."""
    job = Job(2)
    drivers = [job.driver(r) for r in range(2)]
    _together(*(functools.partial(_begin, d) for d in drivers))

    def again(d):
        carry = _carry(8, error="DistError: a transient reset?")
        d.leave(carry)
        return _begin(d, carry)

    first = _together(*(functools.partial(again, d) for d in drivers))
    assert all(s.newest_step == 8 for s in first), first
    second = _together(*(functools.partial(again, d) for d in drivers))
    assert all(isinstance(g, RecurringFailureError) for g in second), second
    assert "failed twice at step 8 with every member alive" in str(second[0])


def test_the_epochs_end_decides_peer_loss_whichever_thread_failed_it_first():
    """NCCL: an aborted group fails in many ways ("no default process group"). The epoch's end
    is marked failed before any collective is failed, by the watch or by a silence alike, so
    the training thread always reads the error as a peer's loss. (Seen failing before: a
    silence aborted without marking the epoch ended.)"""
    job = Job(2)
    drivers = [job.driver(r) for r in range(2)]
    _together(*(functools.partial(_begin, d) for d in drivers))
    no_group = ValueError("Default process group has not been initialized")
    assert not drivers[0].is_peer_loss(no_group)
    liveness = SimpleNamespace(store_lost=False, peer_silent=False, silent_s=4.0)
    members.drop_silent(liveness, "no heartbeat from rank 1", drivers[0].epoch.end)
    assert drivers[0].is_peer_loss(no_group)
    assert not drivers[1].is_peer_loss(no_group)  # its own epoch's end was not failed


def test_nccl_is_prepared_as_the_driver_builds_an_epochs_groups_not_by_a_check(monkeypatch):
    """``refuse_unverified_nccl`` set TORCH_NCCL_ASYNC_ERROR_HANDLING as a side effect of a
    check. The check now changes nothing; the driver prepares NCCL (its watchdog must not end
    the process on an aborted communicator) right before it builds a CUDA epoch's groups."""
    import os

    from elastictrain.inplace import epoch_end

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setenv("ELASTICTRAIN_NCCL_IN_PLACE", "1")
    epoch_end.refuse_unverified_nccl(torch.device("cuda", 0), "--replace-in-place")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    job = Job(1)
    cpu = job.driver(0)
    cpu.form(None, None)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # gloo: nothing to prepare
    cuda = job.driver(0)
    cuda.device = torch.device("cuda", 0)
    cuda.form(None, None)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
