"""The timeline in words: the straggler and one line per rank (printed by the command, and the
picture's title)."""
from __future__ import annotations

from .model import Timeline


def duration(ns: float) -> str:
    """A duration for people: microseconds below a millisecond, milliseconds below ten seconds."""
    if abs(ns) < 1e6:
        return f"{ns / 1e3:.0f} us"
    if abs(ns) < 1e10:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e9:.1f} s"


def headline(timeline: Timeline) -> str:
    ops = sum(len(trace.ops) for trace in timeline.ranks)
    line = f"{len(timeline.ranks)} ranks, {ops} ops, {len(timeline.collectives)} collectives matched"
    straggler = timeline.straggler
    if straggler is None:
        return line + "; no collective to find a straggler in"
    summary = timeline.summaries[[s.rank for s in timeline.summaries].index(straggler)]
    return (f"{line}; straggler: rank {straggler} (last into {summary.times_last} of {summary.collectives}, "
            f"holding the others up {duration(summary.total_margin_ns)} in all)")


def rank_lines(timeline: Timeline) -> list[str]:
    lines = []
    for trace, summary in zip(timeline.ranks, timeline.summaries):
        busy = sum(op.duration_ns for op in trace.ops if op.completed)
        unfinished = sum(not op.completed for op in trace.ops)
        ends = f" ({unfinished} with no end known)" if unfinished else ""
        host = f" ({trace.host})" if trace.host else ""
        lines.append(f"rank {trace.rank}{host}: {len(trace.ops)} ops{ends}, {duration(busy)} in them; last into "
                     f"{summary.times_last} of {summary.collectives} collectives (by {duration(summary.mean_margin_ns)} "
                     f"on average, at most {duration(summary.max_margin_ns)}, {duration(summary.total_margin_ns)} in all); waited {duration(summary.waited_ns)} "
                     f"for the last rank")
    return lines


def report(timeline: Timeline) -> str:
    lines = [headline(timeline), *rank_lines(timeline)]
    lines += [f"not matched: {line}" for line in timeline.unmatched]
    return "\n".join(lines)
