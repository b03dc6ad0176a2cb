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
    # s3fs maps SlowDown/ServiceUnavailable (503) to EBUSY and InternalError (500) to EREMOTEIO.
    errno.EBUSY,
    errno.EREMOTEIO,
}
# S3 error codes worth retrying (botocore's own retry handler treats these as transient too).
_TRANSIENT_S3_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "500",
    "502",
    "503",
    "504",
}
_TRANSIENT_HTTP_STATUS = {500, 502, 503, 504}
# Markers of server-side transient failures as they surface in exception messages.
_TRANSIENT_MARKERS = (
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttl",
    "reduce your request rate",
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
    "FSTimeoutError",
}
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: s3fs re-raises botocore errors as plain OSErrors."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__
    return chain


def _s3_error(exc: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a botocore ClientError, duck-typed so storage needs no boto."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return (str(code) if code is not None else None), status


def _transient_one(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if any(t.__name__ in _TRANSIENT_TYPE_NAMES for t in type(exc).__mro__):
        return True
    code, status = _s3_error(exc)
    if code in _TRANSIENT_S3_CODES or status in _TRANSIENT_HTTP_STATUS:
        return True
    text = str(exc)
    return isinstance(exc, OSError) and any(m in text for m in _TRANSIENT_MARKERS)


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is worth retrying: the same call may succeed a moment later.

    The outermost error decides when it is already classified (our own errors, missing files,
    denied permissions); otherwise any error it wraps may show it is transient.
    """
    if isinstance(exc, (StorageError, *_PERMANENT)):
        return False
    return any(_transient_one(e) for e in _causes(exc))


_CREDENTIAL_S3_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
    "AuthorizationHeaderMalformed",
}


def diagnose(exc: BaseException, *, deadline_s: float) -> str:
    """The likely cause of a failed storage operation and its fix, as one sentence for a user."""
    chain = _causes(exc)
    codes = {_s3_error(e)[0] for e in chain} - {None}
    if codes & _CREDENTIAL_S3_CODES or "NoCredentialsError" in {type(e).__name__ for e in chain}:
        return (
            "the storage rejected the credentials "
            f"({', '.join(sorted(codes & _CREDENTIAL_S3_CODES)) or 'none found'}). Check "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (or --storage-option key=... "
            "secret=...); a session token may have expired."
        )
    if "NoSuchBucket" in codes or any(isinstance(e, FileNotFoundError) for e in chain):
        return (
            "the bucket (or parent directory) does not exist. Create it first, e.g. "
            "'aws s3 mb s3://BUCKET', or fix the URL and --storage-option endpoint_url."
        )
    if (
        "AccessDenied" in codes
        or any(isinstance(e, PermissionError) for e in chain)
        or any(isinstance(e, OSError) and e.errno == errno.EROFS for e in chain)
    ):
        return (
            "the location is not writable (read-only, or the credentials lack write permission "
            "such as s3:PutObject and s3:DeleteObject). Grant write access or choose another "
            "--checkpoint-dir."
        )
    if any(_transient_one(e) for e in chain):
        return (
            f"the storage could not be reached within {deadline_s:.0f}s. Check --storage-option "
            "endpoint_url, the network, and that the service is up."
        )
    return "check that it exists, is writable, and that credentials and endpoint_url are right."


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long to keep retrying a transient storage error."""

    deadline_s: float = 120.0
    """Give up (and re-raise the original error) rather than sleep past this many seconds."""
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

        def sleep_would_pass_deadline(state: tenacity.RetryCallState) -> bool:
            # tenacity's stop_before_delay on our injectable clock: give up now rather than sleep
            # past the deadline, so the deadline is a promise and never overshot by one wait.
            return self.clock() - start + state.upcoming_sleep >= self.deadline_s

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=sleep_would_pass_deadline,
            wait=tenacity.wait_exponential(multiplier=self.initial_wait_s, max=self.max_wait_s)
            + tenacity.wait_random(0, self.initial_wait_s),
            before_sleep=log_before_sleep,
            sleep=self.sleep,
            reraise=True,
        )
        return retrying(fn)
