"""Draws a ``timeline.Timeline`` with matplotlib (the ``[report]`` extra): PNG/SVG/PDF, or HTML with
the picture embedded and the attempts and checkpoints as tables.

Uses ``matplotlib.figure.Figure`` directly, not pyplot: no global state, no display needed.
"""

from __future__ import annotations

import base64
import html
import io

from matplotlib.figure import Figure

from elastictrain.observe.stragglers import SLOW_RATIO
from elastictrain.observe.timeline import Outcome, Timeline

_CAUSE_COLOURS = {
    Outcome.KILL: "tab:red",
    Outcome.HANG: "tab:purple",
    Outcome.PREEMPTION: "tab:orange",
    Outcome.MEMBERSHIP: "tab:brown",
    Outcome.LOST: "tab:green",  # in place: the others kept training
}


def draw(timeline: Timeline, title: str) -> Figure:
    scored = any(a.scores for a in timeline.attempts)  # a run of one rank has no stragglers
    rows = 5 if scored else 4
    fig = Figure(figsize=(11, 12 if scored else 10), layout="constrained")
    grid = fig.add_gridspec(rows, 2, height_ratios=[3, 2, 1, 2, 2][:rows])
    steps, ckpt, world = (fig.add_subplot(grid[row, :]) for row in range(3))
    evals = None
    if any(a.evals for a in timeline.attempts):  # the eval curve beside the loss, on the same steps
        loss, evals = fig.add_subplot(grid[-1, 0]), fig.add_subplot(grid[-1, 1])
    else:
        loss = fig.add_subplot(grid[-1, :])
    if scored:
        scores = fig.add_subplot(grid[3, :], sharex=steps)
        _draw_scores(timeline, scores)
    colours = [f"C{i % 10}" for i in range(len(timeline.attempts))]
    for a, colour in zip(timeline.attempts, colours, strict=True):
        _draw_attempt(a, colour, timeline.t0, steps, world, loss, evals)
    _draw_restarts(timeline, steps, ckpt, world, loss)
    if timeline.max_steps:
        steps.axhline(timeline.max_steps, color="black", lw=0.5, ls=":")
    steps.set(ylabel="completed steps", title=f"{title}: steps over time (v = checkpoint)")
    steps.legend(loc="upper left", fontsize=8)
    _draw_checkpoints(timeline, ckpt)
    world.set(
        ylabel="world size",
        xlabel="seconds since the first start",
        title="world size (grey: downtime, from an attempt's end (in place: its leaving) to the "
        "next one's first step)",
    )
    world.set_ylim(0, max((a.world_size for a in timeline.attempts), default=1) + 1)
    for ax in (ckpt, world):
        ax.sharex(steps)
    steps.set_xlim(left=0)  # the first start: time before the first step is part of the story
    _label_loss(timeline, loss, evals)
    return fig


def _draw_attempt(a, colour: str, t0: float, steps, world, loss, evals) -> None:
    label = f"attempt {a.index} (world {a.world_size})"
    if a.points:
        ts, ss = zip(*sorted(a.points), strict=True)
        steps.plot([t - t0 for t in ts], ss, color=colour, marker=".", ms=3, label=label)
    for c in a.checkpoints:
        steps.plot(c["time"] - t0, c["step"], "v", color=colour, ms=7, mec="black", mew=0.5)
    for s in a.skipped:
        steps.plot(s["time"] - t0, s["step"], "x", color="red", ms=9, mew=2)
    if a.losses:
        ls, lv = zip(*sorted(a.losses), strict=True)
        loss.plot(ls, lv, color=colour, marker=".", ms=3, label=label)
    for r in a.rollbacks:  # back from the step it was decided at to the copy it loaded
        loss.axvspan(r["step"], r["at_step"], color="purple", alpha=0.15, lw=0)
    for i, e in enumerate(a.skipped_steps):  # a step no rank applied: its samples are listed
        loss.axvline(e["step"], color="red", lw=0.8, alpha=0.5, label=None if i else "skipped step")
    if evals is not None:
        for i, name in enumerate(sorted({k for _, m in a.evals for k in m})):
            points = sorted((s, m[name]) for s, m in a.evals if name in m)
            evals.plot(
                *zip(*points, strict=True),
                color=colour,
                marker="os^D"[i % 4],
                ms=4,
                label=f"{name} ({label})",
            )
    end = a.end if a.end is not None else a.start
    world.hlines(a.world_size, a.start - t0, end - t0, color=colour, lw=4)


def _draw_scores(timeline: Timeline, ax) -> None:
    """Each rank's straggler score over time (its median work before the step's first
    synchronisation over the others' median: 1 is as fast as they are); a named straggler is a
    star. Ranks are numbered per attempt: after a resize, rank r may be another process."""
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for a in timeline.attempts:
        for t, ranks in a.scores:
            for rank, score in enumerate(ranks):
                by_rank.setdefault(rank, []).append((t - timeline.t0, score))
    for rank, points in sorted(by_rank.items()):
        ax.plot(*zip(*points, strict=True), marker=".", ms=3, lw=1, label=f"rank {rank}")
    ax.axhline(SLOW_RATIO, color="black", lw=0.5, ls=":")
    for a in timeline.attempts:
        for e in a.stragglers:
            if e.get("slow"):
                t, ratio = e["time"] - timeline.t0, e.get("ratio", SLOW_RATIO)
                ax.plot(t, ratio, "*", color="red", ms=12, mec="black", mew=0.5)
                ax.annotate(f" rank {e.get('rank')} on {e.get('host')}", (t, ratio), fontsize=8)
    ax.set(
        ylabel="x the others' median",
        title="straggler scores: each rank's work before the step's first synchronisation "
        f"(dotted: {SLOW_RATIO}x; star: named a straggler)",
    )
    top = max([SLOW_RATIO] + [score for points in by_rank.values() for _, score in points])
    ax.set_ylim(0, 1.4 * top)  # room for the legend above a slow rank's line
    ax.legend(loc="upper right", fontsize=7, ncol=8)


def _draw_restarts(timeline: Timeline, steps, ckpt, world, loss) -> None:
    """The restart line says why the previous attempt ended; grey is downtime, from the end of
    one attempt (in place: its leaving, the failure seen) to the first trained step of the next."""
    t0 = timeline.t0
    for prev, nxt in timeline.restarts:
        colour = _CAUSE_COLOURS.get(prev.outcome, "grey")
        back = (nxt.trained_at or nxt.start) - t0
        style = ":" if nxt.in_place is not None else "--"  # dotted: recovered in place
        for ax in (steps, ckpt, world):
            ax.axvline(nxt.start - t0, color=colour, ls=style, lw=1)
            if prev.down_from is not None:
                ax.axvspan(prev.down_from - t0, back, color="grey", alpha=0.15, lw=0)
        steps.annotate(
            prev.outcome,
            (nxt.start - t0, nxt.resumed_step),
            xytext=(4, 8),
            textcoords="offset points",
            color=colour,
            fontsize=9,
            rotation=90,
            va="bottom",
        )
        loss.axvline(nxt.resumed_step, color=colour, ls=style, lw=1)


def _draw_checkpoints(timeline: Timeline, ckpt) -> None:
    checkpoints = [c for a in timeline.attempts for c in a.checkpoints]
    if checkpoints:
        times = [c["time"] - timeline.t0 for c in checkpoints]
        ckpt.plot(
            times, [max(c["blocked_s"], 1e-4) for c in checkpoints], "o", label="loop blocked"
        )
        ckpt.plot(times, [max(c["persist_s"], 1e-4) for c in checkpoints], "s", label="persist")
        for t, c in zip(times, checkpoints, strict=True):
            ckpt.annotate(
                str(c["step"]),
                (t, max(c["persist_s"], 1e-4)),
                fontsize=7,
                xytext=(2, 3),
                textcoords="offset points",
            )
        ckpt.set_yscale("log")
        ckpt.legend(loc="upper left", fontsize=8)
    ckpt.set(
        ylabel="seconds (log)", title="checkpoints: time the loop was blocked, time to persist"
    )


def _label_loss(timeline: Timeline, loss, evals) -> None:
    loss.set(
        xlabel="step",
        ylabel="loss (mean over ranks)",
        title="loss across restarts (dashed: resume after a restart; dotted: in place; red: a skipped step; purple: steps a rollback undid)",
    )
    if not any(a.losses for a in timeline.attempts):
        # Library mode logs checkpoints, not progress: say so rather than draw an empty frame.
        loss.text(0.5, 0.5, "no loss in this event log", ha="center", transform=loss.transAxes)
    elif all(v > 0 for a in timeline.attempts for _, v in a.losses):
        loss.set_yscale("log")  # early losses are orders of magnitude above the rest
    if evals is not None:
        evals.set(xlabel="step", ylabel="metric", title="Task.evaluate (mean over ranks)")
        evals.legend(loc="best", fontsize=7)


def render(timeline: Timeline, path: str, title: str) -> None:
    fig = draw(timeline, title)
    if not path.lower().endswith(".html"):
        fig.savefig(path, dpi=100)
        return
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    with open(path, "w") as f:
        f.write(_html(timeline, title, base64.b64encode(png.getvalue()).decode()))


def _html(timeline: Timeline, title: str, png_b64: str) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{a.index}</td><td>{a.start - timeline.t0:.1f}</td><td>{a.world_size}</td>"
        f"<td>{a.resumed_step if a.resumed else '-'}</td><td>{e(a.resumed_from)}</td><td>{a.last_step}</td><td>{len(a.checkpoints)}</td>"
        f"<td{'' if a.outcome == Outcome.FINISHED else ' class=bad'}>{e(a.outcome)}</td>"
        f"<td>{e(a.detail)}</td></tr>"
        for a in timeline.attempts
    )
    ckpts = "".join(
        f"<tr><td>{c['step']}</td><td>{c['time'] - timeline.t0:.1f}</td><td>{e(str(c.get('reason')))}"
        f"</td><td>{c.get('bytes')}</td><td>{c['blocked_s']:.4f}</td><td>{c['persist_s']:.4f}</td></tr>"
        for a in timeline.attempts
        for c in a.checkpoints
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{e(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}.bad{{color:#b00}}</style></head>
<body><h1>{e(title)}</h1><img alt="run report" src="data:image/png;base64,{png_b64}">
<h2>Attempts</h2><table><tr><th>#</th><th>start (s)</th><th>world</th><th>from step</th><th>from copy</th>
<th>to step</th><th>checkpoints</th><th>ended</th><th>detail</th></tr>{rows}</table>
<h2>Checkpoints</h2><table><tr><th>step</th><th>at (s)</th><th>reason</th><th>bytes</th>
<th>blocked (s)</th><th>persist (s)</th></tr>{ckpts}</table></body></html>
"""
