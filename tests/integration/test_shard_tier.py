"""The fast tier for sharded state with 4 real ranks playing 2 nodes of 2 (tests/helpers/
shard_tier_probe.py): a replaced node's shards come from its buddy over the process group, a
buddy copy with a flipped byte is reported and skipped, and with both copies of some shards lost
the durable tier is read; under HSDP with a replica on each node, each node's copies stand in for
the other's and no buddy copy is sent but rank 0's. Every resume is checked tensor by tensor
against the state it saved."""

from __future__ import annotations

import json

import pytest

from elastictrain.checkpoint.api import Tier

PROBE = ("-m", "tests.helpers.shard_tier_probe")


@pytest.mark.slow  # 4 ranks of FSDP2 through 6 resumes: 32 to 38 s in the quick tier
def test_a_lost_node_resumes_from_its_buddy_skips_a_bad_copy_and_falls_back_when_both_are_gone_and_hsdp_replicas_stand_in(
    launch, tmp_path
):
    job = launch([str(tmp_path)], nproc=4, max_restarts=0, entry=PROBE, name="probe", plain=True)
    assert job.wait(240) == 0, job.log()[-4000:]
    seen = json.loads(job.log().split("PROBE ", 1)[1].splitlines()[0])
    assert seen["differs"] == [], seen  # every resume equal, tensor by tensor, to what was saved
    # Fresh; node 1 replaced (step 10); then also a flipped byte (step 20 skipped: 15); then both
    # copies of ranks 2 and 3 lost (the durable tier's step 13).
    # Then HSDP, fresh; node 1 replaced (step 10).
    assert seen["resumed"] == [0, 10, 15, 13, 0, 10], seen
    assert seen["tiers"] == [Tier.FAST, Tier.FAST, Tier.DURABLE, Tier.FAST], seen
    # Node 1's shards came over the process group from node 0; nothing from the durable tier.
    assert seen["peer_bytes"][0] > 0 and seen["durable_bytes"][:2] == [0, 0], seen
    # HSDP: the replicas' copies stood in for each other; rank 0's was the only buddy copy.
    assert seen["hsdp_node0"] == ["own-r00000", "own-r00001"], seen
    assert seen["hsdp_node1"] == ["own-r00002", "own-r00003", "peer-r00000"], seen
    assert seen["peer_bytes"][3] > 0 and seen["durable_bytes"][3] == 0, seen
    assert seen["served_by"][3] == {"0": [0, 1, 2, 3]}, seen  # node 0 served node 1's ranks too
    assert seen["durable_bytes"][2] > 0, seen
    assert seen["corrupt"] == [[20, Tier.FAST, True]], seen  # the buddy copy, named, at step 20
