"""train.numerics in one process: the step lists, the spike detector's judgement, the
non-finite run's rollback and its recurrence."""

from __future__ import annotations

import math
import random

import pytest
import torch

from elastictrain import knobs
from elastictrain.errors import ConfigError, NumericalFaultError
from elastictrain.observe.events import EventLog, SampleLog
from elastictrain.step_list import format_steps, parse_steps
from elastictrain.train import numerics


def test_step_lists_parse_and_print_as_the_flag_spells_them():
    assert sorted(parse_steps("3, 5-7,9")) == [3, 5, 6, 7, 9]
    assert format_steps({9, 3, 5, 6, 7}) == "3,5-7,9" and parse_steps(None) == frozenset()
    with pytest.raises(
        ConfigError, match=r"--skip-steps '4-2': '4-2' must be 0 or more, and A <= B"
    ):
        parse_steps("4-2")
    with pytest.raises(ConfigError, match="'x' is not a step or a range A-B"):
        parse_steps("x")


def test_the_chaos_knobs_pick_their_ranks(monkeypatch):
    monkeypatch.setenv(knobs.NAN, "5-6:1")
    monkeypatch.setenv("RANK", "1")
    assert knobs.nan_steps() == {5, 6}
    monkeypatch.setenv("RANK", "0")
    assert knobs.nan_steps() == frozenset()
    monkeypatch.setenv(knobs.SPIKE, "7")
    assert knobs.spike_steps() == {7}


def _losses(detector, values, first_step=0):
    for i, v in enumerate(values):
        detector.add(first_step + i, torch.tensor(v))


def test_a_spike_is_found_at_its_step_and_a_falling_noisy_loss_never_is():
    rng = random.Random(0)
    learning = [2.0 * math.exp(-i / 300) * (1 + 0.2 * rng.uniform(-1, 1)) for i in range(2000)]
    quiet = numerics.SpikeDetector(10.0)
    for start in range(0, 2000, 37):  # scanned at agreements, a few dozen steps apart
        _losses(quiet, learning[start : start + 37], start)
        assert quiet.scan() is None
    spiky = numerics.SpikeDetector(10.0)
    _losses(spiky, [1.0 + 0.01 * (i % 5) for i in range(50)] + [5.0, 1.0, 1.0])
    assert spiky.scan() == 50
    assert [s for s, _ in spiky.history][-1] == 49  # the spike never joins the history
    spiky.rolled_back(40)
    assert max(s for s, _ in spiky.history) == 39 and spiky.scan() is None


def test_a_heavy_tail_far_above_the_median_but_not_past_the_record_is_no_spike():
    """A small batch's loss has a heavy right tail: many MADs above the median, yet below 2.5x
    the window's highest, it is noise (the toy reached 15 MADs, and 1.93x its window's high)."""
    base = [1.0 + 0.01 * (i % 5) for i in range(49)] + [2.0, 1.0]
    tail, spike = numerics.SpikeDetector(10.0), numerics.SpikeDetector(10.0)
    for detector in (tail, spike):
        _losses(detector, base)
        assert detector.scan() is None  # 2.0: about 90 MADs above, and the new high
    _losses(tail, [4.9], first_step=51)
    assert tail.scan() is None  # below 2.5 x 2.0
    _losses(spike, [5.1], first_step=51)
    assert spike.scan() == 51


def test_too_few_losses_are_never_judged_and_off_is_off():
    early = numerics.SpikeDetector(10.0)
    _losses(early, [1.0] * (numerics.SPIKE_MIN - 1) + [100.0])
    assert early.scan() is None
    off = numerics.SpikeDetector(None)
    _losses(off, [1.0] * 50 + [1e9])
    assert off.scan() is None


def _skips(limit: int) -> numerics.Skips:
    return numerics.Skips(
        limit=limit,
        events=EventLog(None, enabled=False),
        sample_log=SampleLog(None, rank=0, world_size=1, generation=1),
        group=None,
        data_rank=0,
        rank=0,
    )


def test_past_the_limit_a_rollback_then_the_same_fault_straight_after_it_stops(tmp_path):
    skips = _skips(2)
    nan = torch.tensor(math.nan)
    assert skips.record(10, numerics.NON_FINITE, [1, 2], nan) is None
    assert skips.record(11, numerics.NON_FINITE, [3], nan) is None
    back = skips.record(12, numerics.NON_FINITE, [4], nan)
    assert (back.not_after, back.window, back.reason) == (10, [10, 11, 12], numerics.NON_FINITE)
    # After the rollback the window is skipped by name; 13 fails at once: the same fault.
    skips.record(13, numerics.NON_FINITE, [5], nan)
    skips.record(14, numerics.NON_FINITE, [6], nan)
    with pytest.raises(NumericalFaultError, match=r"steps 10-15 .* --skip-steps 10-15"):
        skips.record(15, numerics.NON_FINITE, [7], nan)
    # An applied step between them makes a later run a new fault, not the same one.
    again = _skips(0)
    assert again.record(20, numerics.NON_FINITE, [1], nan).not_after == 20
    again.applied()
    assert again.record(30, numerics.NON_FINITE, [1], nan).not_after == 30
