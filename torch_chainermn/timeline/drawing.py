"""The timeline as a PNG: a row per rank, each op a bar split into its phases, the straggler marked.

Left, time (milliseconds from the first op) runs to the right; a rank whose ops ran on several threads
(the caller's and a group's worker) gets a lane per thread. An op is a grey bar; its phases are drawn
over it in their colours, a phase inside another phase thinner; an op whose end is unknown (a
flight-recorder entry never seen to complete) is a tick where the rank entered it. For every matched
collective a red triangle marks the rank that entered it last, and a red stroke before its bar spans
its margin (how much later it came than the rank before it). Right, per rank: its margins summed
(how long it held the others up) and how many collectives it entered last.

matplotlib is imported here only, through its object-oriented interface (no pyplot, no global
backend switch), so that reading traces needs no matplotlib.
"""

from __future__ import annotations

from pathlib import Path

from .model import Timeline
from .text import headline

PHASE_COLOURS = {
    "within_node": "#4c72b0",
    "between_nodes": "#dd8452",
    "encode": "#55a868",
    "decode": "#8c8c3c",
    "wait_peers": "#c44e52",
    "check": "#8172b3",
}
OTHER_PHASE = "#937860"  # an op run inside another op (drawn as its part)
OP_COLOUR = "#d9d9d9"
LATE = "#d62728"
MATPLOTLIB_MISSING = (
    "drawing the timeline needs matplotlib: pip install 'torch-chainermn[timeline]' (or pip install matplotlib)"
)


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ModuleNotFoundError(MATPLOTLIB_MISSING) from error
    return Figure


def _lanes(timeline: Timeline) -> dict[tuple[int, str], tuple[float, float]]:
    """(rank, thread) -> (y0, height) of that lane: rank r's row spans y = r-0.4 .. r+0.4; the y axis runs
    downwards (rank 0 on top), so y0 is the lane's upper edge on screen."""
    lanes = {}
    for trace in timeline.ranks:
        threads = list(dict.fromkeys(op.thread for op in trace.ops))
        height = 0.8 / len(threads)
        for i, thread in enumerate(threads):
            lanes[(trace.rank, thread)] = (trace.rank - 0.4 + i * height, height)
    return lanes


def draw(timeline: Timeline, path: Path, title: str | None = None) -> Path:
    """Write the picture of `timeline` to `path` (PNG); returns the path."""
    Figure = _figure_class()
    ranks = [trace.rank for trace in timeline.ranks]
    t0 = min(op.start_ns for trace in timeline.ranks for op in trace.ops)
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731
    lanes = _lanes(timeline)

    figure = Figure(figsize=(12, 1.6 + 0.55 * len(ranks)), dpi=100, layout="constrained")
    bars, summary = figure.subplots(1, 2, width_ratios=[5, 1], sharey=True)

    # Ops, then their phases over them (outer phases first, so a phase inside another stays visible).
    boxes: dict[tuple, list] = {}  # (y0, height, colour) -> [(x, width)]: one broken_barh per style
    unfinished = False
    for trace in timeline.ranks:
        for op in trace.ops:
            y0, height = lanes[(trace.rank, op.thread)]
            if not op.completed:  # no end known: a tick where the rank entered it
                bars.plot([ms(op.start_ns)] * 2, [y0, y0 + height], color="#505050", linewidth=1)
                unfinished = True
                continue
            boxes.setdefault((y0, height, OP_COLOUR, -1), []).append((ms(op.start_ns), op.duration_ns / 1e6))
            for phase in op.phases:
                shrink = 0.3 * height * min(phase.depth, 2)
                colour = PHASE_COLOURS.get(phase.name, OTHER_PHASE)
                boxes.setdefault((y0 + shrink / 2, height - shrink, colour, phase.depth), []).append(
                    (ms(phase.start_ns), (phase.end_ns - phase.start_ns) / 1e6)
                )
    for (y0, height, colour, depth), spans in sorted(boxes.items(), key=lambda item: item[0][3]):
        bars.broken_barh(
            spans, (y0, height), facecolors=colour, edgecolors="#7f7f7f" if depth < 0 else "none", linewidth=0.3
        )

    # Who entered each collective last, and by how much.
    for collective in timeline.collectives:
        last = collective.last_rank
        op = collective.ops[last]
        top = lanes[(last, op.thread)][0]  # above the bar, pointing down at its start
        bars.plot(
            [ms(op.start_ns - collective.margin_ns), ms(op.start_ns)],
            [top, top],
            color=LATE,
            linewidth=1.5,
            solid_capstyle="butt",
        )
        bars.plot([ms(op.start_ns)], [top], marker="v", color=LATE, markersize=4)

    straggler = timeline.straggler
    labels = []
    several_hosts = len({trace.host for trace in timeline.ranks}) > 1  # one host's name would only repeat
    for trace in timeline.ranks:
        host = f"\n{trace.host}" if trace.host and several_hosts else ""
        labels.append(f"rank {trace.rank}{host}" + ("\nstraggler" if trace.rank == straggler else ""))
    bars.set_yticks(ranks, labels)
    for tick, rank in zip(bars.get_yticklabels(), ranks):
        if rank == straggler:
            tick.set_color(LATE)
            tick.set_fontweight("bold")
    bars.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
    bars.set_xlabel("time since the first op (ms; each rank's machine clock)")
    bars.grid(axis="x", color="#eeeeee")
    bars.set_axisbelow(True)

    # Per rank: how long it held the others up, and in how many collectives.
    held = [s.total_margin_ns / 1e6 for s in timeline.summaries]
    colours = [LATE if s.rank == straggler else "#7f7f7f" for s in timeline.summaries]
    summary.barh(ranks, held, height=0.5, color=colours)
    for s, x in zip(timeline.summaries, held):
        summary.text(x, s.rank, f" last {s.times_last}/{s.collectives}", va="center", fontsize=8)
    summary.set_xlim(0, max(max(held, default=0), 1e-3) * 1.8)
    summary.set_xlabel("held the others up (ms):\nmargins summed")
    summary.tick_params(labelleft=False)

    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    used = {phase.name for trace in timeline.ranks for op in trace.ops for phase in op.phases}
    legend = []
    if any(op.completed for trace in timeline.ranks for op in trace.ops):
        legend.append(Patch(facecolor=OP_COLOUR, edgecolor="#7f7f7f", label="op"))
    if unfinished:
        legend.append(Line2D([], [], color="#505050", marker="|", linestyle="none", label="op, end unknown"))
    legend += [Patch(facecolor=colour, label=name) for name, colour in PHASE_COLOURS.items() if name in used]
    if used - set(PHASE_COLOURS):
        legend.append(Patch(facecolor=OTHER_PHASE, label="op inside an op"))
    legend.append(Line2D([], [], color=LATE, marker="v", markersize=4, label="entered last (stroke: margin)"))
    figure.legend(handles=legend, loc="outside lower center", ncols=min(len(legend), 8), fontsize=8, frameon=False)
    figure.suptitle(title or headline(timeline), fontsize=10)
    path = Path(path)
    figure.savefig(path)
    return path
