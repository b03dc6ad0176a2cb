"""Every setting, declared once: two kw_only dataclasses, validated in ``__post_init__``.

- :class:`CheckpointConfig`: the checkpoint settings, shared by the runner (``RunConfig.checkpoint``)
  and library mode (``CheckpointManager``'s keyword arguments are exactly its fields).
- :class:`RunConfig`: what only the runner has (task, loop, timeouts of the training collectives).

A field's name is its flag with dashes for underscores (``keep_last`` is ``--keep-last``); a
repeatable flag is the singular (``preempt_signals`` is ``--preempt-signal``, given once per
value). The string below each field is its ``--help`` text and its line in ``docs/cli.md``; the
parser (``flags``) is built from the fields, so nothing here is written twice.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import MISSING, InitVar, dataclass, field, fields
from typing import Any, Literal, get_args, get_type_hints

from elastictrain import mesh
from elastictrain.errors import ConfigError
from elastictrain.runtime.signals import parse_signal
from elastictrain.step_list import parse_steps
from storage.hashing import DEFAULT_ALGORITHM

DEFAULT_TASK = "elastictrain.toy:make_task"

OnStorageFailure = Literal["warn", "fail"]
ResumeRead = Literal["rank0", "all"]
Checksum = Literal["xxh3", "sha256"]  # storage.hashing.ALGORITHMS, checked by a test
Precision = Literal["fp32", "bf16", "fp16"]
Parallel = Literal["ddp", "fsdp", "hsdp"]
ProgressMode = Literal["auto", "live", "plain"]
StragglerAction = Literal["report", "evict", "replace"]


def flag(name: str) -> str:
    """The command-line spelling of a field."""
    return f"--{name.replace('_', '-')}"


def setting(default: Any = MISSING, *, factory: Any = MISSING, metavar: str | None = None) -> Any:
    """A field with its flag's METAVAR (argparse's placeholder in ``--help``)."""
    return field(default=default, default_factory=factory, metadata={"metavar": metavar})


@dataclass(kw_only=True)
class CheckpointConfig:
    checkpoint_dir: str = setting("./checkpoints", metavar="URL")
    """Root URL of the checkpoints: a local path or any fsspec URL (s3://, gcs://, ...). Every node
    must see the same location. memory:// lives only in rank 0's process: for tests."""
    storage_options: dict[str, Any] = setting(factory=dict, metavar="KEY=VALUE")
    """fsspec option, e.g. endpoint_url=...; true/false are booleans, {...} is JSON (repeatable).
    Never logged unredacted."""
    checkpoint_every_steps: int | None = setting(None, metavar="N")
    """Checkpoint every N completed steps; 0 or unset: off."""
    checkpoint_every_seconds: float | None = setting(None, metavar="T")
    """Also checkpoint T seconds after the last one, on rank 0's clock (every rank agrees through
    one small all-reduce); 0 or unset: off. For time only, add --checkpoint-every-steps 0."""
    keep_last: int = setting(3, metavar="K")
    """Committed checkpoints to keep; older ones are deleted only after a newer one commits (a
    failed deletion is logged and retried at the next commit, never fatal)."""
    keep_every_steps: int | None = setting(None, metavar="M")
    """Also keep every checkpoint whose step is a multiple of M (milestones), forever."""
    async_checkpoint: bool = True
    """Persist scheduled checkpoints in the background: the loop is blocked only for the copy of
    the state into reused host memory. The final and preemption checkpoints are always waited for."""
    storage_retry_deadline: float = setting(120.0, metavar="SECONDS")
    """Seconds to keep retrying transient storage errors before an operation fails."""
    on_storage_failure: OnStorageFailure = "warn"
    """A scheduled checkpoint storage refuses past the retry deadline: warn skips it (logged and
    in the events) and keeps training; fail stops the job (exit 7). The final and preemption
    checkpoints always fail the job when they cannot be committed."""
    resume_read: ResumeRead = "rank0"
    """rank0: rank 0 reads the checkpoint once and broadcasts it. all: every rank reads it (for
    states too large to broadcast whole)."""
    checkpoint_timeout: float = setting(1800.0, metavar="SECONDS")
    """Seconds for the barriers around resume and checkpoint saves, where rank 0 may wait on
    storage. Startup (resume and the first step) gets --init-timeout plus this."""
    preempt_signals: tuple[str, ...] = setting(("SIGTERM",), metavar="SIGNAL")
    """Signal that means "checkpoint this step and exit 75" (repeatable). Ctrl-C (SIGINT) always
    does too while any is set; a second Ctrl-C exits 130 at once. Repeated SIGTERMs are ignored:
    schedulers deliver duplicates."""
    event_log: str | None = setting(None, metavar="PATH")
    """JSONL file rank 0 appends start, resume, checkpoint, progress and end events to."""
    checksum: Checksum = DEFAULT_ALGORITHM
    """How checkpoint files are hashed: xxh3 (about 10x faster than sha256; the threat is
    corruption, not forgery) or sha256. Checkpoints written with either keep verifying."""
    local_checkpoint: bool = True
    """Also keep a local tier: each node's copy of the state on node-local storage, taken every
    few steps, so a crashed worker resumes from seconds ago without reading --checkpoint-dir."""
    local_checkpoint_dir: str | None = setting(None, metavar="PATH")
    """Node-local folder of the local tier (unset: a per-job folder under /dev/shm; off, with one
    INFO line, when it lacks room for 3 copies of the state)."""
    local_every_steps: int | Literal["auto"] = setting("auto", metavar="N|auto")
    """Local copies every N steps, or auto: as often as --local-overhead of step time allows,
    measured as the run goes."""
    local_overhead: float = setting(0.02, metavar="FRACTION")
    """The share of step time auto lets the local copies cost."""

    spell: InitVar[Callable[[str], str] | None] = None
    """How errors name a field: the runner passes ``flag`` (``--keep-last``); library mode keeps
    the keyword (``keep_last``)."""

    def __post_init__(self, spell: Callable[[str], str] | None) -> None:
        self.name_of = spell or str
        check_choices(self, self.name_of)
        for name in ("checkpoint_every_steps", "checkpoint_every_seconds"):
            if getattr(self, name) == 0:
                setattr(self, name, None)  # 0 means off, for steps and seconds alike
        if not self.checkpoint_dir:
            raise ConfigError(
                f"{self.name_of('checkpoint_dir')} must not be empty; e.g. ./checkpoints or "
                "s3://bucket/run."
            )
        for name in ("checkpoint_every_steps", "keep_every_steps"):
            if not _whole(getattr(self, name), optional=True):
                raise self._bad(name, "a positive whole number (or 0/None: off)")
        for name in ("keep_last", "storage_retry_deadline", "checkpoint_timeout"):
            if not _positive(getattr(self, name)):
                raise self._bad(name, "> 0")
        if not _positive(self.checkpoint_every_seconds, optional=True):
            raise self._bad("checkpoint_every_seconds", "> 0")
        self._check_signals_and_local_tier()

    def _check_signals_and_local_tier(self) -> None:
        self.preempt_signals = tuple(self.preempt_signals)
        for name in self.preempt_signals:
            parse_signal(name, setting=self.name_of("preempt_signals"))
        if isinstance(self.local_every_steps, str) and self.local_every_steps.isdigit():
            self.local_every_steps = int(self.local_every_steps)
        if self.local_every_steps != "auto" and not _whole(self.local_every_steps):
            raise self._bad("local_every_steps", "a positive whole number or 'auto'")
        if not 0 < self.local_overhead < 1:
            raise self._bad("local_overhead", "a fraction of step time between 0 and 1, e.g. 0.02")

    def _bad(self, name: str, rule: str) -> ConfigError:
        return ConfigError(f"{self.name_of(name)} must be {rule}, got {getattr(self, name)!r}.")


def _runner_checkpoints() -> CheckpointConfig:
    # The runner checkpoints every 100 steps unless told otherwise; a library user picks a schedule.
    return CheckpointConfig(checkpoint_every_steps=100, spell=flag)


@dataclass(kw_only=True)
class RunConfig:
    task: str = setting(DEFAULT_TASK, metavar="MODULE:CALLABLE")
    """MODULE:CALLABLE returning a Task; called with the --task-option dict."""
    task_options: dict[str, str] = setting(factory=dict, metavar="KEY=VALUE")
    """KEY=VALUE option for the task factory (repeatable)."""
    max_steps: int = setting(1000, metavar="N")
    """Train until this many optimizer steps have completed; a final checkpoint is always taken."""
    seed: int = 0
    """Seeds model init, the data order of every epoch, and per-step randomness."""
    precision: Precision = "fp32"
    """bf16 or fp16 run the forward pass and the loss under torch.autocast on the rank's device
    (CPU too); fp16 adds a GradScaler whose state is checkpointed, and its skipped steps are
    counted."""
    parallel: Parallel = "ddp"
    """ddp: every rank holds the whole model and rank 0 checkpoints it. fsdp: FSDP2 shards the
    parameters, gradients and optimizer state over all ranks (Task.shard picks the units; default:
    each child module with parameters, then the root); every rank checkpoints its own shards, and a
    checkpoint resumes at any world size. hsdp: FSDP within each node, one replica per node (each
    shard is checkpointed once, by one replica)."""
    mesh: str | None = setting(None, metavar="DIM=N,...")
    """The device mesh for --parallel fsdp|hsdp, in torchtitan's names: dp_replicate (replicas),
    dp_shard (FSDP within a replica), tp (tensor parallel, innermost: consecutive ranks), e.g.
    dp_replicate=2,tp=4. Omitted: tp 1; fsdp takes dp_replicate 1 and dp_shard the rest; hsdp takes
    dp_shard the ranks of a node over tp and dp_replicate the rest. -1 is the rest. Task.shard gets
    the named mesh; samples are split over the data-parallel ranks (docs/layouts.md)."""
    grad_accum_steps: int = setting(1, metavar="N")
    """Split each rank's share of the global batch into N micro-batches; DDP syncs gradients on
    the last only. The global batch (samples per optimizer step) is unchanged."""
    clip_grad_norm: float | None = setting(None, metavar="X")
    """Clip the total gradient norm to X before each optimizer step; the norm is logged."""
    skip_nonfinite: bool = True
    """Check the whole gradient is finite before each optimizer step (docs/faults.md, "Numerical
    faults"); when not, no rank applies it: its samples are recorded as skipped and training goes
    on. Under fp16 the GradScaler's own overflow skips do this instead."""
    max_consecutive_skips: int = setting(3, metavar="N")
    """Steps in a row skipped for a non-finite gradient before the job rolls back to the newest
    copy before them (node memory first) and skips them; if the next batch fails again, it
    stops (exit 10), naming the steps and their samples."""
    loss_spike_mads: float | None = setting(None, metavar="K")
    """Roll back a loss spike: a rank's loss above the median of its last 100 by K times their
    deviation (MAD) rolls every rank back to the newest copy at or before it and skips the
    batches from there through it (docs/faults.md, "Loss spikes"); unset: off. 10 is cautious."""
    compare_replicas_every: int | None = setting(100, metavar="K")
    """Every K steps compare a digest of each data-parallel replica's parameters (DDP ranks,
    HSDP's twins); a replica that differs (silent data corruption) rolls every rank back to the
    newest copy where they agreed. 0: off."""
    skip_steps: str | None = setting(None, metavar="STEPS")
    """Global steps (0-based) whose batches are drawn, recorded as skipped and not trained, e.g.
    120,130-135: a run told the steps another run skipped trains bitwise like it."""
    num_workers: int = setting(0, metavar="N")
    """DataLoader worker processes that load batches ahead of the loop; 0 loads in the training
    process. The data order is the same for any N."""
    prefetch_factor: int | None = setting(None, metavar="N")
    """Micro-batches each loader worker loads ahead (torch's default, 2, when unset)."""
    eval_every_steps: int | None = setting(None, metavar="N")
    """Run Task.evaluate every N completed steps and at the end; 0 or unset: only at the end (if
    the task has one)."""
    tensorboard: str | None = setting(None, metavar="DIR")
    """Directory rank 0 writes TensorBoard scalars to (pip install 'elastictrain[tensorboard]');
    a resumed run continues the same curves, without duplicate steps."""
    init_timeout: float = setting(900.0, metavar="SECONDS")
    """Seconds for process-group creation and the startup handshake. Generous: nodes start
    minutes apart (image pulls, slow schedulers)."""
    collective_timeout: float = setting(600.0, metavar="SECONDS")
    """Seconds a training collective may wait for the slowest rank; must exceed the worst skew."""
    hang_timeout: float = setting(600.0, metavar="SECONDS")
    """The most seconds without step progress before a rank is declared hung: it dumps its stacks
    and exits 4 so torchrun restarts the group. Once the job has a step time the budget is
    max(--hang-floor, 10 x the slowest of the last 50 steps), never above this."""
    hang_floor: float = setting(60.0, metavar="SECONDS")
    """The least no-progress budget once steps are timed: a step 10x slower than the slowest of
    the last 50 is rare, a 60 s stall of a fast job is not (a storage hiccup, a slow collective)."""
    heartbeat_seconds: float = setting(2.0, metavar="SECONDS")
    """Seconds between each rank's liveness beats through the job's store, from a thread that does
    not wait for the step: W store requests a second at the default."""
    silent_timeout: float = setting(15.0, metavar="SECONDS")
    """Seconds without a peer's heartbeat before every rank exits 8 naming it, so torchrun re-forms
    the group without a frozen host instead of waiting --collective-timeout. Above the 10 s stall
    a live rank must survive (swap storm, long GC). 0 turns liveness off."""
    replace_in_place: bool = False
    """Keep the ranks that did not fail training: each rank's process supervises its training
    process and a pre-imported spare; a training process that dies (SIGKILL, OOM, a segfault) is
    replaced by the spare, which receives the state from a survivor's memory (DDP: any survivor;
    HSDP: its shards' twin in another replica), and only the step in flight is redone. FSDP
    without replicas rolls every rank back to the fast tier's newest whole copy, in the same
    processes. Anything else falls back to torchrun's restart of the group (docs/faults.md,
    "In-place recovery")."""
    replace_wait: float = setting(0.5, metavar="SECONDS")
    """Seconds the survivors wait for a dead rank's replacement (its spare answers within a
    tenth of a second) before going on without it: a rank not back by then is taken for lost with
    its node, and the others continue at the smaller world size."""
    replace_timeout: float = setting(60.0, metavar="SECONDS")
    """Seconds an in-place recovery may take once its members are known (the new process groups,
    the state from a survivor); past it, torchrun restarts the group."""
    max_replacements: int = setting(3, metavar="N")
    """Replacements each rank's supervisor makes; past them a death restarts the group (and no
    spare is kept once they are spent)."""
    spare_nodes: int = setting(0, metavar="N")
    """Nodes of the torchrun job that stand by instead of training (the last N by torchrun's node
    rank): their ranks import torch, build the task and wait. A lost, frozen or evicted node's
    ranks are taken over by a spare node in place, so the world size and the data split do not
    change (needs --replace-in-place; docs/multinode.md). With none left, the job shrinks."""
    straggler_action: StragglerAction = "report"
    """What a rank named a straggler (persistently slower than the others: docs/faults.md,
    "Stragglers") costs it: report logs and records it; evict also drops its node in place, the
    way a lost node is dropped (a spare node takes its place if one stands by); replace hands its
    node's ranks to a spare node and is refused when none stands by (never shrinks the job).
    Both need --replace-in-place and stay within --min-nodes and --max-evictions-per-hour."""
    min_nodes: int | None = setting(None, metavar="N")
    """Training nodes an eviction never goes below; default torchrun's --nnodes minimum (MIN of
    MIN:MAX, read from the agent's command line) less --spare-nodes, else 1."""
    max_evictions_per_hour: int = setting(1, metavar="N")
    """Evictions the job makes in any hour; past them a straggler is reported only. A bad node
    is rare; a policy that evicts node after node is evicting for a cause no node has."""
    self_check: bool = True
    """At every start, check each node before it trains (docs/faults.md, "Self-checks"): a
    compute check compared across nodes, the job's store round trip, room for the node-memory
    tier. A failing node is left out if the job can go on without it; else exit 2."""
    sample_log: str | None = setting(None, metavar="DIR")
    """Directory where every rank appends the dataset indices it trains on (the exactly-once ledger)."""
    log_every_seconds: float = setting(10.0, metavar="SECONDS")
    """Seconds between rank 0's progress lines and progress events."""
    progress: ProgressMode = "auto"
    """Rank 0's display: live redraws one status line in place, plain prints a line every
    --log-every-seconds, auto is live on an interactive terminal and plain otherwise."""
    checkpoint: CheckpointConfig = field(default_factory=_runner_checkpoints)
    """The checkpoint settings (their flags are listed with the rest)."""

    def __post_init__(self) -> None:
        check_choices(self, flag)
        if ":" not in self.task:
            raise ConfigError(
                f"--task must be MODULE:CALLABLE, e.g. {DEFAULT_TASK}; got {self.task!r}."
            )
        names = (
            "max_steps",
            "init_timeout",
            "collective_timeout",
            "hang_timeout",
            "hang_floor",
            "heartbeat_seconds",
        )
        for name in names:
            if not _positive(getattr(self, name)):
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)!r}.")
        check_silent_timeout(self.silent_timeout, self.heartbeat_seconds, flag)
        self._check_in_place()
        if not _positive(self.log_every_seconds):
            raise ConfigError(f"--log-every-seconds must be > 0, got {self.log_every_seconds!r}.")
        if self.mesh is not None:
            mesh.parse(self.mesh)  # the syntax now; the sizes against the world size at start
        self._check_loop()

    def _check_in_place(self) -> None:
        if not (_positive(self.replace_timeout) and _positive(self.replace_wait)):
            raise ConfigError(
                f"--replace-wait and --replace-timeout must be > 0, got {self.replace_wait!r} and "
                f"{self.replace_timeout!r}."
            )
        if self.max_replacements < 0:
            raise ConfigError(
                f"--max-replacements must be 0 or more, got {self.max_replacements!r}."
            )
        if self.straggler_action != "report" and not self.replace_in_place:
            what = {"evict": "drops a node", "replace": "hands a node's ranks to a spare"}
            raise ConfigError(
                f"--straggler-action {self.straggler_action} {what[self.straggler_action]} in "
                "place: add --replace-in-place, or use --straggler-action report."
            )
        if self.spare_nodes != 0 and not _whole(self.spare_nodes):
            raise ConfigError(f"--spare-nodes must be 0 or more, got {self.spare_nodes!r}.")
        if self.spare_nodes and not self.replace_in_place:
            raise ConfigError(
                f"--spare-nodes {self.spare_nodes}: a spare node takes a lost node's ranks in "
                "place: add --replace-in-place."
            )
        if self.straggler_action == "replace" and not self.spare_nodes:
            raise ConfigError(
                "--straggler-action replace hands a straggler's node's ranks to a spare node: "
                "add --spare-nodes N (N >= 1), or use --straggler-action evict."
            )
        if self.min_nodes is not None and self.min_nodes < 1:
            raise ConfigError(f"--min-nodes must be 1 or more, got {self.min_nodes!r}.")
        if self.max_evictions_per_hour < 0:
            raise ConfigError(
                f"--max-evictions-per-hour must be 0 or more, got {self.max_evictions_per_hour!r}."
            )

    def _check_loop(self) -> None:
        if self.eval_every_steps == 0:
            self.eval_every_steps = None
        for name in ("grad_accum_steps", "prefetch_factor", "eval_every_steps"):
            value = getattr(self, name)
            if not _whole(value, optional=name != "grad_accum_steps"):
                raise ConfigError(f"{flag(name)} must be a positive whole number, got {value!r}.")
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers must be 0 or more, got {self.num_workers!r}.")
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ConfigError(
                f"--prefetch-factor {self.prefetch_factor} needs loader workers: add "
                "--num-workers N (N >= 1), or drop --prefetch-factor."
            )
        if not _positive(self.clip_grad_norm, optional=True):
            raise ConfigError(f"--clip-grad-norm must be > 0, got {self.clip_grad_norm!r}.")
        if not _positive(self.loss_spike_mads, optional=True):
            raise ConfigError(f"--loss-spike-mads must be > 0, got {self.loss_spike_mads!r}.")
        for name in ("compare_replicas_every", "max_consecutive_skips"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{flag(name)} must be 0 or more, got {getattr(self, name)!r}.")
        parse_steps(self.skip_steps)
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                f"--tensorboard {self.tensorboard} needs the tensorboard package: "
                "pip install 'elastictrain[tensorboard]' (or drop --tensorboard)."
            )


def check_silent_timeout(
    silent_timeout: float, heartbeat_seconds: float, name_of: Callable[[str], str]
) -> None:
    """0 (off), or at least two beats: a rank is only silent once it missed more than one. The
    runner's flags and ``init_distributed``'s keywords alike (``name_of`` spells them)."""
    if silent_timeout < 0 or (silent_timeout and silent_timeout < 2 * heartbeat_seconds):
        raise ConfigError(
            f"{name_of('silent_timeout')} must be 0 (off) or at least twice "
            f"{name_of('heartbeat_seconds')} ({2 * heartbeat_seconds:g}s), got "
            f"{silent_timeout!r}: a rank is only silent after missing more than one beat."
        )


def check_choices(config: Any, name_of: Callable[[str], str]) -> None:
    """Every ``Literal`` field holds one of its choices (the choices are the type, written once)."""
    for name, kind in get_type_hints(type(config)).items():
        choices = get_args(kind) if getattr(kind, "__origin__", None) is Literal else ()
        if choices and getattr(config, name) not in choices:
            listed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
            raise ConfigError(f"{name_of(name)} must be {listed}, got {getattr(config, name)!r}.")


def _positive(value: Any, optional: bool = False) -> bool:
    return (value is None and optional) or (value is not None and value > 0)


def _whole(value: Any, optional: bool = False) -> bool:
    if value is None:
        return optional
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def settings(cls: type) -> list[str]:
    """The names of ``cls``'s settings, in declaration order (a nested config is not one)."""
    return [f.name for f in fields(cls) if f.name != "checkpoint"]
