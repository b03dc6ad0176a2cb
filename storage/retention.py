"""Which checkpoints to delete: keep the newest ``keep_last`` committed ones."""

from __future__ import annotations


def steps_to_delete(
    committed_steps: list[int], keep_last: int, newest_good: int, keep_every: int | None = None
) -> list[int]:
    """Committed steps beyond the newest ``keep_last``; never ``newest_good``, never a milestone
    (a multiple of ``keep_every``).

    ``keep_last`` counts committed checkpoints, so a deletion only ever follows a newer commit.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}.")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}.")
    ordered = sorted(committed_steps, reverse=True)
    return sorted(
        s
        for s in ordered[keep_last:]
        if s != newest_good and not (keep_every and s % keep_every == 0)
    )


def partial_steps_to_delete(
    step_dirs: list[int], committed_steps: list[int], newest_good: int
) -> list[int]:
    """Uncommitted step dirs older than ``newest_good``: leftovers of writers that died.

    ``newest_good`` is the newest step that verifies (the one the caller just committed), never
    merely the newest manifest: a manifest above the run's progress (a stale generation's late
    commit, a corrupt newest step) would put every step this run is writing now below it. Every
    writer of the current run has moved past ``newest_good`` (its files were all reported before
    it committed), so nothing below it is being written; dirs above it are left alone.
    """
    committed = set(committed_steps)
    return sorted(s for s in step_dirs if s < newest_good and s not in committed)
