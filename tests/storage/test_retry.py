from __future__ import annotations

import errno
import logging

import pytest

from storage import RetryPolicy, is_transient
from storage.errors import CheckpointCorruptError


class FakeTime:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s

    def clock(self) -> float:
        return self.now


class _ClientError(Exception):
    """Shaped like botocore's ClientError: storage must classify it without importing boto."""

    def __init__(self, response):
        super().__init__(str(response))
        self.response = response


def _client_error(code: str, status: int) -> Exception:
    return _ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}})


def _wrapped(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause  # how s3fs re-raises botocore errors
    return outer


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError("reset"),
        TimeoutError("read timed out"),
        OSError(errno.ETIMEDOUT, "timed out"),
        OSError("An error occurred (SlowDown) when calling the PutObject operation"),
        OSError("An error occurred (503) when calling PutObject: Service Unavailable"),
        OSError(errno.EBUSY, "Please reduce your request rate."),  # s3fs's SlowDown
        OSError(errno.EREMOTEIO, "We encountered an internal error."),  # s3fs's InternalError
        _wrapped(OSError(errno.EIO, "opaque"), _client_error("BadGateway", 502)),
        _wrapped(OSError(errno.EIO, "opaque"), _client_error("SlowDown", 503)),
    ],
)
def test_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError("nope"),
        PermissionError("denied"),
        ValueError("bad"),
        CheckpointCorruptError("bad checksum"),
        OSError(errno.ENOSPC, "No space left on device"),
        _wrapped(PermissionError("Access Denied"), _client_error("AccessDenied", 403)),
        _wrapped(OSError(errno.EIO, "opaque"), _client_error("InvalidArgument", 400)),
    ],
)
def test_not_transient(exc):
    assert not is_transient(exc)


def test_retries_transient_then_succeeds(caplog):
    t = FakeTime()
    policy = RetryPolicy(
        deadline_s=60, initial_wait_s=1, max_wait_s=8, sleep=t.sleep, clock=t.clock
    )
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError("reset by peer")
        return "ok"

    with caplog.at_level(logging.WARNING, logger="storage.retry"):
        assert policy.call("write x", flaky) == "ok"
    assert len(calls) == 4
    assert len(t.sleeps) == 3
    assert t.sleeps[1] >= t.sleeps[0] * 1.0 and all(s <= 8 + 1 for s in t.sleeps)
    assert caplog.text.count("transient storage error during write x") == 3


def test_stops_at_deadline_and_reraises_original():
    t = FakeTime()
    policy = RetryPolicy(
        deadline_s=10, initial_wait_s=1, max_wait_s=4, sleep=t.sleep, clock=t.clock
    )
    err = ConnectionResetError("down for good")

    def always():
        raise err

    with pytest.raises(ConnectionResetError) as info:
        policy.call("read y", always)
    assert info.value is err
    # Never past the deadline (no sleep that would cross it is started), and not given up more
    # than one maximum wait (4) plus jitter (1) early.
    assert 10 - 4 - 1 <= t.now <= 10, t.sleeps


def test_permanent_error_is_not_retried():
    t = FakeTime()
    policy = RetryPolicy(sleep=t.sleep, clock=t.clock)
    with pytest.raises(PermissionError):
        policy.call("write z", lambda: (_ for _ in ()).throw(PermissionError("denied")))
    assert t.sleeps == []


def test_policy_validates():
    with pytest.raises(ValueError, match="deadline_s"):
        RetryPolicy(deadline_s=-1)
