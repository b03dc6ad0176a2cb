"""Prove a checkpoint location usable before any compute is spent: write, read back, delete.

Uses a deadline of its own (at most the store's), so a misconfigured URL fails in seconds with
:class:`StorageNotUsableError` naming the likely cause: a missing bucket, rejected credentials, a
read-only location, or an unreachable endpoint.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from storage.backend import Backend
from storage.errors import StorageNotUsableError, StorageUnavailableError
from storage.retry import diagnose

logger = logging.getLogger(__name__)

Call = Callable[[str, Callable[[], Any]], Any]
"""Run one storage operation with the store's retries: ``call(what, fn)``."""


def probe_location(
    backend: Backend, call: Call, *, deadline_s: float, safe_url: str, write: bool
) -> None:
    outcome: list[BaseException | None] = []
    worker = threading.Thread(
        target=lambda: outcome.append(_probe_once(backend, call, write)),
        name="storage-probe",
        daemon=True,
    )
    worker.start()
    # The retry deadline is only checked between attempts, and one attempt inside s3fs and
    # botocore retries on its own, far past the deadline (docs/measurements.md). The budget is a
    # promise to the user, so it is enforced here; a late attempt is abandoned.
    worker.join(deadline_s + 2.0)
    error = outcome[0] if outcome else TimeoutError(f"no answer within {deadline_s:.0f}s")
    if error is None:
        return
    cause = (
        error.__cause__ if isinstance(error, StorageUnavailableError) and error.__cause__ else error
    )
    raise StorageNotUsableError(
        f"Checkpoint location {safe_url!r} is not usable: "
        f"{diagnose(cause, deadline_s=deadline_s)} "
        f"({type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''})"
    ) from error


def _probe_once(backend: Backend, call: Call, write: bool) -> BaseException | None:
    """Write, read back and delete the probe object (or only list the root); the error, or None
    when usable."""
    path = backend.join(backend.root, f".probe-{uuid.uuid4().hex}")
    payload = b"elastictrain storage probe"
    written = False
    try:
        if not write:
            return call("probe list", backend.check_readable)
        written = call("probe write", lambda: backend.create(path, payload))
        if call("probe read", lambda: backend.read(path)) != payload:
            raise StorageUnavailableError("the probe object read back different bytes")
        check_create(backend, call, path, payload)
    except Exception as e:  # noqa: BLE001 - every failure here means "not usable"; diagnose it
        return e
    finally:
        # A leftover probe object is harmless, and a failed cleanup must not mask the real error;
        # nothing to clean when the write failed (against a dead endpoint it costs seconds).
        if written:
            with contextlib.suppress(Exception):
                backend.delete_file(path)
    return None


def check_create(backend: Backend, call: Call, path: str, payload: bytes) -> None:
    """Where the server is trusted to refuse a taken name (``create_guarantee == "atomic"``), ask
    it once: an S3 look-alike that ignores ``If-None-Match`` would let a second create overwrite.
    Then every create looks first, and a warning says that write-once is checked, not enforced."""
    if getattr(backend, "create_guarantee", "") != "atomic":
        return
    if call("probe create", lambda: backend.create(path, payload)):
        backend.look_first = True
        backend.create_guarantee = "checked"
        logger.warning(
            "the checkpoint location %s ignored a conditional write (If-None-Match): a file "
            "is looked for before it is created, so write-once holds against this job's own "
            "retries but not against a second writer racing for the same name "
            "(docs/checkpoints.md, 'Write-once')",
            backend.root,
        )
