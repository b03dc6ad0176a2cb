"""elastictrain.checkpoint.resume.ranking: which copy a resume picks."""

from __future__ import annotations

from elastictrain.checkpoint.api import Tier
from elastictrain.checkpoint.resume.ranking import candidates


def test_resume_ranks_by_generation_then_step_and_prefers_a_local_copy():
    offers = [
        {
            "fence": 30,
            "durable": [(30, 40, 2, False), (20, 90, 2, True)],
            "local": [(30, 40, 2), (30, 35, 2)],
        },
        {"fence": 0, "durable": [], "local": [(30, 45, 2), (31, 99, 2), (0, 50, 2)]},
    ]
    ranked = [(c.generation, c.step, c.tier, c.rank) for c in candidates(offers)]
    assert ranked == [
        (30, 45, Tier.LOCAL, 1),  # a peer's newer copy; (31, 99) was never fenced: not offered
        (30, 40, Tier.LOCAL, 0),  # the same step locally before durably
        (30, 40, Tier.DURABLE, 0),
        (30, 35, Tier.LOCAL, 0),
        (20, 90, Tier.DURABLE, 0),  # an older generation, whatever its step
    ]
