"""``python -m elastictrain report EVENTS.jsonl -o report.png|.html``: one picture of a run's life.

``timeline`` turns the event log into attempts and causes; ``report_plot`` draws them (matplotlib,
the ``[report]`` extra). Without matplotlib the text summary is still printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from elastictrain.errors import EXIT_USER_ERROR
from elastictrain.observe.events import read_events
from elastictrain.observe.timeline import build_timeline, summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elastictrain report",
        description="Draw a run's life (steps, restarts and causes, checkpoints, world size, loss) "
        "from the JSONL event log that --event-log writes.",
    )
    parser.add_argument("events", help="the --event-log file")
    parser.add_argument("-o", "--output", required=True, help="report.png or report.html")
    args = parser.parse_args(argv)
    ext = os.path.splitext(args.output)[1].lower()
    if ext not in (".png", ".html", ".svg", ".pdf"):
        print(f"error: -o {args.output!r}: use a .png, .svg, .pdf or .html name", file=sys.stderr)
        return EXIT_USER_ERROR
    if not os.path.isfile(args.events):
        print(
            f"error: no event log at {args.events!r}; training writes one with --event-log PATH",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    timeline = build_timeline(read_events(args.events))
    if not timeline.attempts:
        print(
            f"error: {args.events!r} holds no 'start' event: not an elastictrain event log?",
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
        return EXIT_USER_ERROR
    from elastictrain.observe import report_plot

    report_plot.render(timeline, args.output, title=os.path.basename(args.events))
    print(summary(timeline))
    print(f"wrote {args.output}")
    return 0
