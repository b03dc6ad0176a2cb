"""elastictrain.runtime.signals: stop signals become a flag."""

from __future__ import annotations

import os
import signal

import pytest

from elastictrain.errors import ConfigError
from elastictrain.runtime.signals import StopSignals, parse_signal


def test_stop_signal_only_sets_a_flag():
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        stop = StopSignals([signal.SIGUSR2])
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested and stop.received == signal.SIGUSR2 and stop.received_at is not None
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_parse_signal():
    assert parse_signal("usr1") == signal.SIGUSR1 and parse_signal("SIGTERM") == signal.SIGTERM
    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal name"):
        parse_signal("SIGNOPE")
