"""The restart handshake on a real TCPStore: stale advertisements are never trusted."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastictrain.dist import ATTEMPT_KEY, handshake
from elastictrain.env import DistEnv
from elastictrain.errors import InitTimeoutError


def _env(rank: int, world: int) -> DistEnv:
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=rank,
        local_world_size=world,
        master_addr="127.0.0.1",
        master_port=0,
        restart_count=1,
        max_restarts=3,
        run_id="t",
        use_agent_store=True,
        launched_by_torchrun=True,
    )


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


def test_stale_advertisement_is_not_trusted(server):
    # What a killed attempt leaves behind in torchrun's long-lived store.
    stale = "1000-deadbeef0000-3"
    server.set(ATTEMPT_KEY, stale)
    server.set(f"{stale}/join/1", "old-rank-1")
    server.set(f"{stale}/welcome/old-rank-1", "1")
    results = {}

    def run(rank):
        results[rank] = handshake(_client(server), _env(rank, 3), timeout=20)

    late_zero = threading.Thread(target=run, args=(0,))
    others = [threading.Thread(target=run, args=(r,)) for r in (1, 2)]
    for t in others:
        t.start()
    time.sleep(0.5)  # ranks 1 and 2 have read (and joined) the stale attempt by now
    late_zero.start()
    for t in [*others, late_zero]:
        t.join(30)
    assert len(results) == 3
    nonces = {a.nonce for a in results.values()}
    assert len(nonces) == 1 and stale not in nonces
    assert results[0].generation > 1000


def test_missing_rank0_times_out_clearly(server):
    t0 = time.monotonic()
    with pytest.raises(InitTimeoutError, match="init-timeout"):
        handshake(_client(server), _env(1, 2), timeout=1.0)
    assert time.monotonic() - t0 < 5


def test_missing_worker_times_out_clearly(server):
    with pytest.raises(InitTimeoutError, match=r"ranks \['1'\]"):
        handshake(_client(server), _env(0, 2), timeout=1.0)
