"""Run configuration: one kw_only dataclass, validated up front, and its command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from elastictrain.errors import ConfigError
from storage.urls import parse_option

DEFAULT_TASK = "elastictrain.toy:make_task"


@dataclass(kw_only=True)
class RunConfig:
    task: str = DEFAULT_TASK
    """``MODULE:CALLABLE`` returning a Task; called with the ``--task-option`` dict."""
    task_options: dict[str, str] = field(default_factory=dict)
    """Free-form ``KEY=VALUE`` options handed to the task factory."""
    checkpoint_dir: str = "./checkpoints"
    """Root URL of the checkpoints: a local path or any fsspec URL (s3://, memory://, ...)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to the fsspec filesystem, e.g. ``endpoint_url`` for S3. Never logged unredacted."""
    max_steps: int = 1000
    """Train until this many optimizer steps have completed; a final checkpoint is always taken."""
    checkpoint_every_steps: int | None = 100
    """Commit a checkpoint every N steps (0 or None: off)."""
    checkpoint_every_seconds: float | None = None
    """Also commit when this many seconds passed since the last one; rank 0's clock decides for all."""
    keep_last: int = 3
    """Committed checkpoints to keep; older ones are deleted only after a newer one commits."""
    keep_every_steps: int | None = None
    """Also keep every checkpoint whose step is a multiple of this ("milestones"), forever."""
    seed: int = 0
    """Seeds model init, the data order of every epoch, and per-step randomness."""
    init_timeout: float = 900.0
    """Seconds for process-group creation and the startup handshake. Generous: nodes start
    minutes apart (image pulls, slow schedulers)."""
    collective_timeout: float = 600.0
    """Seconds a training collective may wait for the slowest rank. Must exceed worst skew."""
    checkpoint_timeout: float = 1800.0
    """Seconds for the barriers around resume and checkpoint saves, where rank 0 may be slow
    because of storage."""
    hang_timeout: float = 600.0
    """Seconds without step progress before a rank is declared hung: stacks are dumped and the
    worker exits 4 so torchrun restarts the group. Must exceed the slowest legitimate step."""
    preempt_signal: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals that mean "save at the next step boundary and exit 75"."""
    storage_retry_deadline: float = 120.0
    """Seconds to keep retrying transient storage errors before an operation fails."""
    async_checkpoint: bool = True
    """Persist scheduled checkpoints in the background: training is blocked only for the copy of
    the state into host memory. The final and preemption checkpoints are always waited for."""
    on_storage_failure: str = "warn"
    """A scheduled checkpoint whose storage stays down past the retry deadline: ``warn`` skips it
    (logged and in the events) and keeps training; ``fail`` stops the job (exit 7). The final and
    preemption checkpoints always fail the job when they cannot be committed."""
    resume_read: str = "rank0"
    """``rank0``: rank 0 reads the checkpoint once and broadcasts it. ``all``: every rank reads it
    (for very large states, where one broadcast of the whole state is the bottleneck)."""
    sample_log: str | None = None
    """Directory where every rank appends the dataset indices it trains on (the exactly-once ledger)."""
    event_log: str | None = None
    """Rank 0 appends JSON lines (start, resume, checkpoint, progress, end) to this local file."""
    log_every_seconds: float = 10.0
    """Seconds between rank 0's progress lines and progress events."""
    progress: str = "auto"
    """Rank 0's display: ``live`` redraws one status line in place, ``plain`` prints a line every
    ``log_every_seconds``, ``auto`` is live on an interactive terminal and plain otherwise."""

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if value is None or value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value!r}.")

        if ":" not in self.task:
            raise ConfigError(
                f"--task must be MODULE:CALLABLE, e.g. {DEFAULT_TASK}; got {self.task!r}."
            )
        if self.checkpoint_every_steps == 0:
            self.checkpoint_every_steps = None
        for name in (
            "max_steps",
            "keep_last",
            "init_timeout",
            "collective_timeout",
            "checkpoint_timeout",
            "hang_timeout",
            "storage_retry_deadline",
            "log_every_seconds",
        ):
            positive(name)
        positive("checkpoint_every_steps", allow_none=True)
        positive("checkpoint_every_seconds", allow_none=True)
        positive("keep_every_steps", allow_none=True)
        from elastictrain.watchdog import parse_signal  # config must not import it at module load

        for name in self.preempt_signal:
            parse_signal(name)
        if self.on_storage_failure not in ("warn", "fail"):
            raise ConfigError(
                f"--on-storage-failure must be 'warn' or 'fail', got {self.on_storage_failure!r}."
            )
        if self.resume_read not in ("rank0", "all"):
            raise ConfigError(f"--resume-read must be 'rank0' or 'all', got {self.resume_read!r}.")
        if not self.checkpoint_dir:
            raise ConfigError(
                "--checkpoint-dir must not be empty; e.g. ./checkpoints or s3://bucket/run."
            )


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _storage_option(text: str) -> tuple[str, object]:
    try:
        return parse_option(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    defaults = RunConfig()
    p = argparse.ArgumentParser(
        prog="torchrun ... -m elastictrain",
        description="Fault-tolerant elastic training. Without torchrun, 'python -m elastictrain "
        "SUBCOMMAND' runs a tool: ls|verify|inspect|prune URL (checkpoints), report EVENTS.jsonl "
        "-o report.png|.html (a run's life), bench (checkpoint speed).",
    )

    def add(name: str, **kw) -> None:
        kw.setdefault("default", getattr(defaults, name))
        kw.setdefault("help", f"(default: {kw['default']})")
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, **kw)

    add("task", help=f"MODULE:CALLABLE returning a Task (default: {DEFAULT_TASK})")
    p.add_argument(
        "--task-option",
        dest="task_options",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="option for the task factory (repeatable)",
    )
    add(
        "checkpoint_dir",
        metavar="URL",
        help="local path or fsspec URL (s3://, memory://, ...) (default: ./checkpoints)",
    )
    p.add_argument(
        "--storage-option",
        dest="storage_options",
        action="append",
        type=_storage_option,
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option, e.g. endpoint_url=...; true/false are booleans, {...} is JSON "
        "(repeatable)",
    )
    add(
        "max_steps",
        type=int,
        help="optimizer steps to train; a final checkpoint is always taken (default: 1000)",
    )
    add(
        "checkpoint_every_steps",
        type=int,
        metavar="N",
        help="checkpoint every N steps; 0 disables (default: 100)",
    )
    add(
        "checkpoint_every_seconds",
        type=float,
        metavar="T",
        help="also checkpoint T seconds after the last one; rank 0's clock decides (default: off)",
    )
    add("keep_last", type=int, metavar="K", help="committed checkpoints to keep (default: 3)")
    add(
        "keep_every_steps",
        type=int,
        metavar="M",
        help="also keep milestone checkpoints at multiples of M steps (default: off)",
    )
    add("seed", type=int, help="seeds init, data order and per-step randomness (default: 0)")
    add(
        "init_timeout",
        type=float,
        metavar="SECONDS",
        help="process-group creation and startup handshake; ranks may start minutes apart (default: 900)",
    )
    add(
        "collective_timeout",
        type=float,
        metavar="SECONDS",
        help="a training collective's wait for the slowest rank (default: 600)",
    )
    add(
        "checkpoint_timeout",
        type=float,
        metavar="SECONDS",
        help="barriers around resume and saves, where rank 0 waits on storage (default: 1800)",
    )
    add(
        "hang_timeout",
        type=float,
        metavar="SECONDS",
        help="no step progress this long means hung: dump stacks, exit 4 (default: 600)",
    )
    p.add_argument(
        "--preempt-signal",
        dest="preempt_signal",
        action="append",
        default=None,
        metavar="SIGNAL",
        help="save at the next step boundary and exit 75 on this signal (repeatable; default: SIGTERM)",
    )
    add(
        "storage_retry_deadline",
        type=float,
        metavar="SECONDS",
        help="keep retrying transient storage errors this long (default: 120)",
    )
    add(
        "async_checkpoint",
        action=argparse.BooleanOptionalAction,
        help="persist scheduled checkpoints in the background; the loop blocks only for a copy of "
        "the state into reused host memory (default: on)",
    )
    add(
        "on_storage_failure",
        choices=["warn", "fail"],
        help="a scheduled checkpoint storage rejects past the retry deadline: warn = skip it and "
        "keep training, fail = stop the job, exit 7 (default: warn)",
    )
    add(
        "resume_read",
        choices=["rank0", "all"],
        help="rank0: read the checkpoint once and broadcast; all: every rank reads (default: rank0)",
    )
    add(
        "sample_log",
        metavar="DIR",
        help="every rank appends the indices it trains on (default: none)",
    )
    add("event_log", metavar="PATH", help="JSONL event log appended by rank 0 (default: none)")
    add(
        "log_every_seconds",
        type=float,
        metavar="SECONDS",
        help="progress line interval (default: 10)",
    )
    add(
        "progress",
        choices=["auto", "live", "plain"],
        help="rank 0's display: live status line, plain periodic lines, or auto: live on a "
        "terminal (default: auto)",
    )
    return p


def parse_args(argv: list[str]) -> RunConfig:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    values["task_options"] = dict(values["task_options"])
    values["storage_options"] = dict(values["storage_options"])
    if values["preempt_signal"] is None:
        values.pop("preempt_signal")
    return RunConfig(**values)
