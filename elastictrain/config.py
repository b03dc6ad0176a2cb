"""Run configuration: one kw_only dataclass, validated up front, and its command line.

Each field's docstring is its ``--help`` text, and its default is printed from the field itself:
the help is written once. The checkpoint settings are validated by ``SessionConfig`` (the same
rules library mode follows), with errors that name the flag.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import inspect
from dataclasses import dataclass, field, fields
from typing import Any

from elastictrain.errors import ConfigError
from storage.urls import parse_option

DEFAULT_TASK = "elastictrain.toy:make_task"


@dataclass(kw_only=True)
class RunConfig:
    task: str = DEFAULT_TASK
    """MODULE:CALLABLE returning a Task; called with the --task-option dict."""
    task_options: dict[str, str] = field(default_factory=dict)
    """KEY=VALUE option for the task factory (repeatable)."""
    checkpoint_dir: str = "./checkpoints"
    """Root URL of the checkpoints: a local path or any fsspec URL (s3://, memory://, ...). Every
    node must see the same location."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec option, e.g. endpoint_url=...; true/false are booleans, {...} is JSON (repeatable).
    Never logged unredacted."""
    max_steps: int = 1000
    """Train until this many optimizer steps have completed; a final checkpoint is always taken."""
    checkpoint_every_steps: int | None = 100
    """Checkpoint every N completed steps; 0 turns it off."""
    checkpoint_every_seconds: float | None = None
    """Also checkpoint T seconds after the last one, on rank 0's clock; 0 or unset: off."""
    keep_last: int = 3
    """Committed checkpoints to keep; older ones are deleted only after a newer one commits."""
    keep_every_steps: int | None = None
    """Also keep every checkpoint whose step is a multiple of M (milestones), forever."""
    seed: int = 0
    """Seeds model init, the data order of every epoch, and per-step randomness."""
    precision: str = "fp32"
    """bf16 or fp16 run the forward pass and the loss under torch.autocast on the rank's device
    (CPU too); fp16 adds a GradScaler whose state is checkpointed, and its skipped steps are
    counted."""
    parallel: str = "ddp"
    """ddp: every rank holds the whole model and rank 0 checkpoints it. fsdp: FSDP2 shards the
    parameters, gradients and optimizer state over all ranks (Task.shard picks the units; default:
    each child module with parameters, then the root); every rank checkpoints its own shards, and a
    checkpoint resumes at any world size."""
    grad_accum_steps: int = 1
    """Split each rank's share of the global batch into N micro-batches; DDP syncs gradients on
    the last only. The global batch (samples per optimizer step) is unchanged."""
    clip_grad_norm: float | None = None
    """Clip the total gradient norm to X before each optimizer step; the norm is logged."""
    num_workers: int = 0
    """DataLoader worker processes that load batches ahead of the loop; 0 loads in the training
    process. The data order is the same for any N."""
    prefetch_factor: int | None = None
    """Micro-batches each loader worker loads ahead (torch's default, 2, when unset)."""
    eval_every_steps: int | None = None
    """Run Task.evaluate every N completed steps and at the end; 0 or unset: only at the end (if
    the task has one)."""
    tensorboard: str | None = None
    """Directory rank 0 writes TensorBoard scalars to (pip install 'elastictrain[tensorboard]');
    a resumed run continues the same curves, without duplicate steps."""
    init_timeout: float = 900.0
    """Seconds for process-group creation and the startup handshake. Generous: nodes start
    minutes apart (image pulls, slow schedulers)."""
    collective_timeout: float = 600.0
    """Seconds a training collective may wait for the slowest rank; must exceed the worst skew."""
    checkpoint_timeout: float = 1800.0
    """Seconds for the barriers around resume and checkpoint saves, where rank 0 may wait on
    storage. Startup (resume and the first step) gets --init-timeout plus this."""
    hang_timeout: float = 600.0
    """Seconds without step progress before a rank is declared hung: it dumps its stacks and exits
    4 so torchrun restarts the group. Must exceed the slowest legitimate step."""
    preempt_signal: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signal that means "checkpoint this step and exit 75" (repeatable). Ctrl-C (SIGINT) always
    does too; a second Ctrl-C exits 130 at once."""
    storage_retry_deadline: float = 120.0
    """Seconds to keep retrying transient storage errors before an operation fails."""
    async_checkpoint: bool = True
    """Persist scheduled checkpoints in the background: the loop is blocked only for the copy of
    the state into reused host memory. The final and preemption checkpoints are always waited for."""
    on_storage_failure: str = "warn"
    """A scheduled checkpoint storage refuses past the retry deadline: warn skips it (logged and
    in the events) and keeps training; fail stops the job (exit 7). The final and preemption
    checkpoints always fail the job when they cannot be committed."""
    resume_read: str = "rank0"
    """rank0: rank 0 reads the checkpoint once and broadcasts it. all: every rank reads it (for
    states too large to broadcast whole)."""
    checksum: str = "xxh3"
    """How checkpoint files are hashed: xxh3 (about 10x faster than sha256; the threat is
    corruption, not forgery) or sha256. Checkpoints written with either keep verifying."""
    local_checkpoint: bool = True
    """Also keep a local tier: each node's copy of the state on node-local storage, taken every
    few steps, so a crashed worker resumes from seconds ago without reading --checkpoint-dir."""
    local_checkpoint_dir: str | None = None
    """Node-local folder of the local tier (unset: a per-job folder under /dev/shm; off, with one
    INFO line, when it lacks room for 3 copies of the state)."""
    local_every_steps: str = "auto"
    """Local copies every N steps, or auto: as often as --local-overhead of step time allows,
    measured as the run goes."""
    local_overhead: float = 0.02
    """The share of step time auto lets the local copies cost."""
    sample_log: str | None = None
    """Directory where every rank appends the dataset indices it trains on (the exactly-once ledger)."""
    event_log: str | None = None
    """JSONL file rank 0 appends start, resume, checkpoint, progress and end events to."""
    log_every_seconds: float = 10.0
    """Seconds between rank 0's progress lines and progress events."""
    progress: str = "auto"
    """Rank 0's display: live redraws one status line in place, plain prints a line every
    --log-every-seconds, auto is live on an interactive terminal and plain otherwise."""

    def __post_init__(self) -> None:
        if ":" not in self.task:
            raise ConfigError(
                f"--task must be MODULE:CALLABLE, e.g. {DEFAULT_TASK}; got {self.task!r}."
            )
        for name in ("checkpoint_every_steps", "checkpoint_every_seconds"):
            if getattr(self, name) == 0:
                setattr(self, name, None)  # 0 means off, for steps and seconds alike
        for name in (
            "max_steps",
            "init_timeout",
            "collective_timeout",
            "log_every_seconds",
        ):
            value = getattr(self, name)
            if value is None or value <= 0:
                raise ConfigError(f"{flag(name)} must be > 0, got {value!r}.")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"--precision must be fp32, bf16 or fp16, got {self.precision!r}.")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"--parallel must be ddp or fsdp, got {self.parallel!r}.")
        if self.eval_every_steps == 0:
            self.eval_every_steps = None
        for name in ("grad_accum_steps", "prefetch_factor", "eval_every_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{flag(name)} must be a positive whole number, got {value!r}.")
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers must be 0 or more, got {self.num_workers!r}.")
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ConfigError(
                f"--prefetch-factor {self.prefetch_factor} needs loader workers: add "
                "--num-workers N (N >= 1), or drop --prefetch-factor."
            )
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"--clip-grad-norm must be > 0, got {self.clip_grad_norm!r}.")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                f"--tensorboard {self.tensorboard} needs the tensorboard package: "
                "pip install 'elastictrain[tensorboard]' (or drop --tensorboard)."
            )
        self.session_config()  # the checkpoint settings: validated where library mode's are

    def session_config(self):  # -> SessionConfig (imported here: it needs torch)
        from elastictrain.checkpoint.session import SessionConfig

        names = {
            "url": "checkpoint_dir",
            "every_steps": "checkpoint_every_steps",
            "every_seconds": "checkpoint_every_seconds",
            "async_save": "async_checkpoint",
            "timeout_s": "checkpoint_timeout",
            "preempt_signals": "preempt_signal",
        }
        return SessionConfig(
            url=self.checkpoint_dir,
            storage_options=self.storage_options,
            every_steps=self.checkpoint_every_steps,
            every_seconds=self.checkpoint_every_seconds,
            keep_last=self.keep_last,
            keep_every_steps=self.keep_every_steps,
            async_save=self.async_checkpoint,
            storage_retry_deadline=self.storage_retry_deadline,
            on_storage_failure=self.on_storage_failure,
            resume_read=self.resume_read,
            timeout_s=self.checkpoint_timeout,
            hang_timeout=self.hang_timeout,
            preempt_signals=tuple(self.preempt_signal),
            event_log=self.event_log,
            checksum=self.checksum,
            local_checkpoint=self.local_checkpoint,
            local_checkpoint_dir=self.local_checkpoint_dir,
            local_every_steps=self.local_every_steps,
            local_overhead=self.local_overhead,
            spelling={
                f.name: flag(names.get(f.name, f.name))
                for f in fields(SessionConfig)
                if f.name != "spelling"
            },
        )


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


@functools.cache
def field_docs() -> dict[str, str]:
    """Each RunConfig field's docstring (the string right below it), whitespace collapsed."""
    tree = ast.parse(inspect.getsource(RunConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        doc = (
            nxt.value.value
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            else None
        )
        if isinstance(node, ast.AnnAssign) and isinstance(doc, str):
            docs[node.target.id] = " ".join(doc.split())
    return docs


def _shown(value: Any) -> str:
    if value is None or value is False:
        return "off"
    if value is True:
        return "on"
    if isinstance(value, list):
        return ", ".join(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


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
    from elastictrain.tools import TOOLS

    defaults = RunConfig()
    docs = field_docs()
    p = argparse.ArgumentParser(
        prog="torchrun ... -m elastictrain",
        description="Fault-tolerant elastic training. Without torchrun, 'python -m elastictrain "
        "COMMAND' runs a tool: "
        + "; ".join(f"{name}: {what}" for name, (_, what) in TOOLS.items())
        + ".",
    )

    def add(name: str, option: str | None = None, **kw: Any) -> None:
        default = getattr(defaults, name)
        kw.setdefault("default", default)
        shown = "none" if kw["default"] == [] else _shown(default)
        # argparse expands %; the docs are prose.
        kw["help"] = f"{docs[name].replace('%', '%%')} (default: {shown})"
        p.add_argument(option or flag(name), dest=name, **kw)

    add("task")
    add(
        "task_options",
        "--task-option",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
    )
    add("checkpoint_dir", metavar="URL")
    add(
        "storage_options",
        "--storage-option",
        action="append",
        type=_storage_option,
        default=[],
        metavar="KEY=VALUE",
    )
    add("max_steps", type=int)
    add("checkpoint_every_steps", type=int, metavar="N")
    add("checkpoint_every_seconds", type=float, metavar="T")
    add("keep_last", type=int, metavar="K")
    add("keep_every_steps", type=int, metavar="M")
    add("seed", type=int)
    add("precision", choices=["fp32", "bf16", "fp16"])
    add("parallel", choices=["ddp", "fsdp"])
    add("grad_accum_steps", type=int, metavar="N")
    add("clip_grad_norm", type=float, metavar="X")
    add("num_workers", type=int, metavar="N")
    add("prefetch_factor", type=int, metavar="N")
    add("eval_every_steps", type=int, metavar="N")
    add("tensorboard", metavar="DIR")
    for name in ("init_timeout", "collective_timeout", "checkpoint_timeout", "hang_timeout"):
        add(name, type=float, metavar="SECONDS")
    add("preempt_signal", action="append", default=None, metavar="SIGNAL")
    add("storage_retry_deadline", type=float, metavar="SECONDS")
    add("async_checkpoint", action=argparse.BooleanOptionalAction)
    add("on_storage_failure", choices=["warn", "fail"])
    add("resume_read", choices=["rank0", "all"])
    add("checksum", choices=["xxh3", "sha256"])
    add("local_checkpoint", action=argparse.BooleanOptionalAction)
    add("local_checkpoint_dir", metavar="PATH")
    add("local_every_steps", metavar="N|auto")
    add("local_overhead", type=float, metavar="FRACTION")
    add("sample_log", metavar="DIR")
    add("event_log", metavar="PATH")
    add("log_every_seconds", type=float, metavar="SECONDS")
    add("progress", choices=["auto", "live", "plain"])
    return p


def parse_args(argv: list[str]) -> RunConfig:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    values["task_options"] = dict(values["task_options"])
    values["storage_options"] = dict(values["storage_options"])
    if values["preempt_signal"] is None:
        values.pop("preempt_signal")
    return RunConfig(**values)
