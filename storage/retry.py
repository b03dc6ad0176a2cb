"""Retry transient storage errors, and nothing else.

A retry policy is a deadline plus backoff; ``sleep`` is injectable so unit tests never wait.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

from storage.errors import StorageError

logger = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EAGAIN,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
}
# Markers of server-side transient failures as they surface through s3fs/botocore/aiohttp messages.
_TRANSIENT_MARKERS = (
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttl",
    "503",
    "500 ",
    "(500)",
    "Connection reset",
    "Read timeout",
    "timed out",
)
_TRANSIENT_TYPE_NAMES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectionError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientPayloadError",
    "IncompleteReadError",
}


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is worth retrying: the same call may succeed a moment later."""
    if isinstance(exc, StorageError):
        return False  # already classified by us
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if any(t.__name__ in _TRANSIENT_TYPE_NAMES for t in type(exc).__mro__):
        return True
    text = str(exc)
    return isinstance(exc, OSError) and any(m in text for m in _TRANSIENT_MARKERS)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long to keep retrying a transient storage error."""

    deadline_s: float = 120.0
    """Give up (and re-raise the original error) once this many seconds have passed."""
    initial_wait_s: float = 0.5
    """First backoff; doubles each retry, with jitter."""
    max_wait_s: float = 15.0
    """Cap on a single backoff."""
    sleep: Callable[[float], None] = time.sleep
    """Injectable so tests can assert the waits without waiting."""
    clock: Callable[[], float] = time.monotonic
    """Injectable clock the deadline is measured on."""

    def __post_init__(self) -> None:
        for name in ("deadline_s", "initial_wait_s", "max_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RetryPolicy.{name} must be >= 0, got {getattr(self, name)}.")

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient errors until the deadline; ``what`` names it in logs."""

        def log_before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            logger.warning(
                "transient storage error during %s (attempt %d): %s: %s; retrying in %.2fs",
                what,
                state.attempt_number,
                type(exc).__name__,
                exc,
                state.next_action.sleep if state.next_action else 0.0,
            )

        start = self.clock()

        def past_deadline(state: tenacity.RetryCallState) -> bool:
            return self.clock() - start >= self.deadline_s

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=past_deadline,
            wait=tenacity.wait_exponential(multiplier=self.initial_wait_s, max=self.max_wait_s)
            + tenacity.wait_random(0, self.initial_wait_s),
            before_sleep=log_before_sleep,
            sleep=self.sleep,
            reraise=True,
        )
        return retrying(fn)
