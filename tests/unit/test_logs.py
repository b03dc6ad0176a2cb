"""elastictrain.observe.logs: what each rank prints."""

from __future__ import annotations

import logging

from elastictrain.observe.logs import setup_logging


def test_other_ranks_log_only_warnings(monkeypatch):
    monkeypatch.delenv("ELASTICTRAIN_LOG_LEVEL", raising=False)
    try:
        setup_logging(1)
        assert logging.getLogger().level == logging.WARNING
        setup_logging(0)
        assert logging.getLogger().level == logging.INFO
        monkeypatch.setenv("ELASTICTRAIN_LOG_LEVEL", "DEBUG")
        setup_logging(3)
        assert logging.getLogger().level == logging.DEBUG
    finally:
        monkeypatch.delenv("ELASTICTRAIN_LOG_LEVEL")
        setup_logging(0)
