"""A real S3 endpoint on loopback (moto_server), for the fixtures and the manual measurements."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from tests.helpers.net import free_port


@contextlib.contextmanager
def moto_server(env: dict[str, str] | None = None):
    """A moto_server S3 endpoint on a free loopback port; killed by its own process group."""
    if shutil.which("moto_server") is None:
        pytest.fail("moto_server not found: install the test extras (pip install -e '.[test]')")
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 30
    while True:  # a bare TCP connect: with auth on, every HTTP request counts against the budget
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"moto_server did not start on port {port}")
            time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
