"""``python -m elastictrain report URL|EVENTS.jsonl... -o report.png|.html``: one picture of a run's
life, from the history kept with its checkpoints or from event log files.

``timeline`` turns the event log into attempts and causes; ``report_plot`` draws them (matplotlib,
the ``[report]`` extra). Without matplotlib the text summary is still printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import storage
from elastictrain.errors import EXIT_USER_ERROR
from elastictrain.observe.goodput import goodput
from elastictrain.observe.history import merge_lines
from elastictrain.observe.timeline import build_timeline, summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elastictrain report",
        description="Draw a run's life (steps, restarts and causes, checkpoints, world size, loss) "
        "from its checkpoint location, where rank 0 mirrors the event log and every rank leaves "
        "its last words, or from --event-log files (one per host; merged by time).",
    )
    parser.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a checkpoint location (folder or URL: s3://bucket/run) or an --event-log file",
    )
    parser.add_argument("-o", "--output", required=True, help="report.png or report.html")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    ext = os.path.splitext(args.output)[1].lower()
    if ext not in (".png", ".html", ".svg", ".pdf"):
        print(f"error: -o {args.output!r}: use a .png, .svg, .pdf or .html name", file=sys.stderr)
        return EXIT_USER_ERROR
    options = dict(storage.parse_option(kv) for kv in args.storage_option)
    texts = []
    for source in args.sources:
        text = _read_source(source, options)
        if text is None:
            print(
                f"error: {source!r} is neither an event log file nor a checkpoint location with a "
                "run history (events/): training writes the history beside its checkpoints, and "
                "a local log with --event-log PATH",
                file=sys.stderr,
            )
            return EXIT_USER_ERROR
        texts += text
    timeline = build_timeline(merge_lines(texts))
    if not timeline.attempts:
        print(
            f"error: {' '.join(args.sources)!r} holds no 'start' event: not an elastictrain run?",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "error: drawing the report needs matplotlib, which is not installed. Install it with "
            "pip install 'elastictrain[report]'. The text summary follows.",
            file=sys.stderr,
        )
        print(summary(timeline))
        print(goodput(timeline).line())
        return EXIT_USER_ERROR
    from elastictrain.observe import report_plot

    title = args.sources[0] if len(args.sources) == 1 else f"{len(args.sources)} sources"
    report_plot.render(timeline, args.output, title=os.path.basename(title.rstrip("/")) or title)
    print(summary(timeline))
    print(goodput(timeline).line())
    print(f"wrote {args.output}")
    return 0


def _read_source(source: str, options: dict) -> list[str] | None:
    """The JSONL texts of one source: a local event log file, or every history file under a
    checkpoint location. None when it is neither."""
    if os.path.isfile(source):
        with open(source, errors="replace") as f:
            return [f.read()]
    texts = [data.decode(errors="replace") for _, data in read_history_files(source, options)]
    return texts or None


def read_history_files(url: str, options: dict) -> list[tuple[str, bytes]]:
    return storage.open_store(url, storage_options=options).read_history()
