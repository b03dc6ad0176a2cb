"""``--tensorboard DIR``: rank 0's scalars, continued across restarts without duplicate steps.

An attempt that resumes from step k retrains steps after k, which the crashed attempt may already
have logged. ``SummaryWriter(purge_step=k + 1)`` records a marker that makes TensorBoard drop every
earlier event at a step >= k + 1, so each step appears once: the one of the attempt that
committed. Every write is flushed, so a crash loses no point the checkpoint kept.
"""

from __future__ import annotations

from collections.abc import Mapping


class Scalars:
    """Writes ``prefix/name`` scalars on rank 0; a no-op without a directory or on other ranks."""

    def __init__(self, log_dir: str | None, *, resume_step: int, enabled: bool) -> None:
        self._writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir, purge_step=resume_step + 1)

    def write(self, step: int, prefix: str, values: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for name, value in values.items():
            self._writer.add_scalar(f"{prefix}/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
