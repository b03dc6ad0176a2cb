"""The bench command line: one subcommand per bench, each with its own options and defaults."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile

import storage
from elastictrain.errors import ConfigError
from elastictrain.tools.sizes import parse_size

# subcommand -> (module, what it measures, default --size or None)
BENCHES = {
    "persist": ("persist", "a checkpoint's cost on your storage against its floors", "1GB"),
    "sharded": ("sharded", "FSDP2 sharded checkpoints (2 ranks save, 3 resume) against DCP", "1GB"),
    "recovery": ("recovery", "kill a worker of a real torchrun job: kill -> first step", "64MB"),
    "tiers": ("tiers", "the local tier against a slow durable tier, side by side", "256MB"),
    "overhead": ("overhead", "the runner's per-step cost against a plain DDP loop", None),
    "loader": ("loader", "loader workers against in-process loading", None),
    "scale": ("scale", "the real protocol for W simulated ranks, W up to 8,192", None),
    "numerics": ("numerics", "the numerical-fault checks against a training step", "59MB"),
}

# The boolean flags of earlier releases, accepted for one more with a warning.
OLD_FLAGS = {
    "--recovery": "recovery",
    "--overhead": "overhead",
    "--loader": "loader",
    "--sharded": "sharded",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m elastictrain bench",
        description="Manual measurements, each beside its floor in one run. "
        "'bench SUBCOMMAND --help' lists a bench's options.",
    )
    sub = p.add_subparsers(dest="bench", required=True, metavar="SUBCOMMAND")
    benches = {}
    for name, (_, what, size) in BENCHES.items():
        b = sub.add_parser(name, help=what, description=what)
        b.add_argument("--json", action="store_true", help="print the figures as JSON")
        if size is not None:
            b.add_argument(
                "--size", type=parse_size, default=parse_size(size), help=f"state size ({size})"
            )
        if name not in ("recovery", "scale"):
            b.add_argument(
                "--repeats", type=int, default=3, help="runs per figure; the median is shown (3)"
            )
        benches[name] = b
    for name in ("persist", "sharded"):
        benches[name].add_argument(
            "--checkpoint-dir",
            default=tempfile.gettempdir(),
            metavar="URL",
            help="where to measure (a scratch folder is made under it and removed)",
        )
    _storage_options(benches)
    _tiers_options(benches["tiers"])
    _work_options(benches)
    _scale_options(benches["scale"])
    return p


def _storage_options(benches: dict[str, argparse.ArgumentParser]) -> None:
    """persist, sharded and recovery: where and what they measure."""
    benches["persist"].add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE"
    )
    benches["recovery"].add_argument(
        "--in-place",
        action="store_true",
        help="also run 4 ranks as 2 simulated nodes of 2, with --replace-in-place and without: "
        "each rank's training process SIGKILLed in turn, then a node; kill -> the survivors' "
        "next completed step in both modes",
    )
    benches["recovery"].add_argument(
        "--spares",
        action="store_true",
        help="with --in-place: the node kill once more with a spare node standing by (3 "
        "simulated nodes, --spare-nodes 1): its ranks take the lost node's places",
    )
    benches["recovery"].add_argument(
        "--parallel",
        choices=("ddp", "fsdp", "hsdp"),
        default="ddp",
        help="the --in-place job's layout: hsdp is a replica per node (2x2), fsdp shards over "
        "all 4 ranks and rolls back to its node-memory copies (ddp)",
    )
    for name in ("persist", "numerics"):
        benches[name].add_argument(
            "--device", default="cpu", help="where the state lives: cpu, or cuda for GPU memory"
        )
    benches["sharded"].add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="R",
        help="also save the state as HSDP over R replicas of the 2 shards (2R ranks), against "
        "FSDP at 2 and dcp.save (1: off)",
    )


def _tiers_options(tiers: argparse.ArgumentParser) -> None:
    tiers.add_argument(
        "--remote-mbps",
        type=float,
        default=50.0,
        metavar="MB/S",
        help="the durable tier's link speed (50)",
    )
    tiers.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="ddp: a replica per node; fsdp: each rank's shards and its buddy's (ddp)",
    )
    tiers.add_argument(
        "--every",
        type=int,
        default=100,
        metavar="N",
        help="durable checkpoint interval in steps; the kill comes at 1.5 N (100)",
    )
    tiers.add_argument(
        "--local-every",
        default="auto",
        metavar="N|auto",
        help="the two-tier job's --local-every-steps (auto): a fixed N takes auto's "
        "load-dependent interval out of a comparison on a busy host",
    )


def _work_options(benches: dict[str, argparse.ArgumentParser]) -> None:
    """overhead and loader: the step's work."""
    benches["overhead"].add_argument("--steps", type=int, default=2000, help="steps per run")
    loader = benches["loader"]
    loader.add_argument("--workers", type=int, default=2, help="loader workers (2)")
    loader.add_argument("--load-ms", type=float, default=50.0, help="load time per batch (50)")
    loader.add_argument("--compute-ms", type=float, default=50.0, help="compute per step (50)")
    loader.add_argument("--steps", type=int, default=60, help="steps per run (60)")


def _scale_options(scale: argparse.ArgumentParser) -> None:
    scale.add_argument(
        "--worlds",
        default="8,64,512,4096,8192",
        metavar="W,W,...",
        type=lambda text: [int(w) for w in text.split(",")],
        help="world sizes to simulate (8,64,512,4096,8192)",
    )
    scale.add_argument(
        "--processes",
        metavar="W,W,...",
        type=lambda text: [int(w) for w in text.split(",")],
        help="instead: the whole runner with W real torchrun workers on this host, at each W",
    )
    scale.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="with --processes: how the toy model is wrapped (ddp)",
    )
    scale.add_argument("--latency-ms", type=float, default=20.0, help="per storage request (20)")
    scale.add_argument(
        "--layout",
        choices=("fsdp", "hsdp", "tp"),
        default="fsdp",
        help="the simulated sharding: fsdp, Shard(0) over W; hsdp, W/8 replicas of 8 shards; "
        "tp, (dp_shard W/2, tp 2) (fsdp)",
    )
    scale.add_argument("--tensors", type=int, default=3000, help="sharded tensors (3000)")
    scale.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="skip a phase at a W where its growth says it would take longer (300): the default runs every W to 8,192 in under 10 minutes on 2 cores",
    )


def _upgrade(argv: list[str]) -> list[str]:
    """``bench --recovery ...`` (earlier releases) as ``bench recovery ...``, with a warning."""
    if argv and not argv[0].startswith("-") or argv[:1] in (["-h"], ["--help"]):
        return argv
    old = next((a for a in argv if a in OLD_FLAGS), None)
    name = OLD_FLAGS.get(old, "persist")
    if name == "recovery" and any(a.startswith("--remote-mbps") for a in argv):
        name = "tiers"
    rest = [a for a in argv if a != old]
    old_line, new_line = " ".join(["bench", *argv]), " ".join(["bench", name, *rest])
    print(f"warning: '{old_line}' is deprecated: use '{new_line}'", file=sys.stderr)
    return [name, *rest]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(_upgrade(argv))
    bench = importlib.import_module(f"elastictrain.bench.{BENCHES[args.bench][0]}")
    if args.bench == "persist":
        options = dict(storage.parse_option(kv) for kv in args.storage_option)
        return bench.main(
            args.checkpoint_dir, options, args.size, args.repeats, args.device, args.json
        )
    if args.bench == "sharded":
        return bench.main(args.size, args.repeats, args.json, args.checkpoint_dir, args.replicas)
    if args.bench == "recovery":
        if args.parallel != "ddp" and not args.in_place:
            raise ConfigError(
                f"bench recovery --parallel {args.parallel} sets the layout of the --in-place "
                "job; add --in-place (the 2-rank restart bench is DDP's)."
            )
        if args.spares and not args.in_place:
            raise ConfigError("bench recovery --spares is a case of --in-place: add --in-place.")
        return bench.main(args.size, args.json, args.in_place, args.parallel, args.spares)
    if args.bench == "tiers":
        return bench.main(
            args.size,
            args.remote_mbps,
            args.repeats,
            args.json,
            args.parallel,
            args.every,
            args.local_every,
        )
    if args.bench == "scale" and args.processes:
        from elastictrain.bench import processes

        return processes.main(args.processes, args.parallel, args.json)
    if args.bench == "scale":
        return bench.main(
            args.worlds, args.latency_ms, args.tensors, args.budget_s, args.json, args.layout
        )
    if args.bench == "overhead":
        return bench.main(args.steps, args.repeats, args.json)
    if args.bench == "numerics":
        return bench.main(args.size, args.repeats, args.json, args.device)
    return bench.main(
        args.workers,
        args.load_ms / 1e3,
        args.compute_ms / 1e3,
        args.steps,
        args.repeats,
        args.json,
    )
