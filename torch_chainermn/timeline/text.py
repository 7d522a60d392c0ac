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
    # The time the ops span, to weigh the margins against: 4 ms late in half a second is no straggler.
    ops = [op for trace in timeline.ranks for op in trace.ops]
    shown = max(op.end_ns for op in ops) - min(op.start_ns for op in ops)
    share = f", {100 * summary.total_margin_ns / shown:.1f}% of the {duration(shown)} shown" if shown > 0 else ""
    return (
        f"{line}; straggler: rank {straggler} (last into {summary.times_last} of {summary.collectives}, "
        f"holding the others up {duration(summary.total_margin_ns)} in all{share})"
    )


def rank_lines(timeline: Timeline) -> list[str]:
    lines = []
    for trace, summary in zip(timeline.ranks, timeline.summaries):
        busy = sum(op.duration_ns for op in trace.ops if op.completed)
        unfinished = sum(not op.completed for op in trace.ops)
        ends = f" ({unfinished} with no end known)" if unfinished else ""
        host = f" ({trace.host})" if trace.host else ""
        last = (
            f"last into {summary.times_last} of {summary.collectives} collectives (by "
            f"{duration(summary.mean_margin_ns)} on average, at most {duration(summary.max_margin_ns)}, "
            f"{duration(summary.total_margin_ns)} in all)"
        )
        lines.append(
            f"rank {trace.rank}{host}: {len(trace.ops)} ops{ends}, {duration(busy)} in them; {last}; "
            f"waited {duration(summary.waited_ns)} for the last rank"
        )
    return lines


def report(timeline: Timeline) -> str:
    lines = [headline(timeline), *rank_lines(timeline)]
    hosts = {trace.host for trace in timeline.ranks if trace.host}
    if len(hosts) > 1:
        lines.append(
            f"the ranks ran on {len(hosts)} hosts: each rank's times are its host's clock, so a margin "
            f"between hosts includes their clocks' offset (NTP: about a millisecond)"
        )
    lines += [f"not matched: {line}" for line in timeline.unmatched]
    return "\n".join(lines)
