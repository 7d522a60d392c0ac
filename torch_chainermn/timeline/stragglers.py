"""Who held the others up: the collectives matched across ranks, and per rank how often it came last.

A collective is the same op on every rank that runs it. A profiler trace does not say which process
group an op ran on, so there the n-th op of a name on every rank is one collective, provided every rank
ran that name as often (a profiler window that differs between the ranks, or ops on subgroups that
not every rank joins, leave the name unmatched; ops on subgroups that every rank runs as often, such as
each node's own group, are matched as if one). A flight-recorder dump names the group and the op's
sequence number in it: there ops are matched by (group, sequence number) among the ranks that ran them.

The rank that entered a collective last made everybody else wait: its start, less the start of the
rank before it, is its margin (the least anyone waited for it). Point-to-point ops are drawn but not
matched: a send has one partner, not a group that waits.
"""

from __future__ import annotations

import statistics

from .model import Collective, Op, RankSummary, RankTrace, Timeline

POINT_TO_POINT = ("send", "recv", "send_message", "recv_message")


def _collectives_of(
    name: str, group: str | None, ops_by_rank: dict[int, list[Op]], unmatched: list[str]
) -> list[Collective]:
    """The collectives of one op name (on one group) across the ranks that ran it."""
    label = name if group is None else f"{name} on group {group}"
    if len(ops_by_rank) < 2:
        unmatched.append(f"{label}: ran on rank {next(iter(ops_by_rank))} alone")
        return []
    if all(op.seq is not None for ops in ops_by_rank.values() for op in ops):
        by_seq: dict[int, dict[int, Op]] = {}
        for rank, ops in ops_by_rank.items():
            for op in ops:
                by_seq.setdefault(op.seq, {})[rank] = op
        everyone = len(ops_by_rank)
        complete = [seq for seq in sorted(by_seq) if len(by_seq[seq]) == everyone]
        if len(complete) < len(by_seq):
            unmatched.append(
                f"{label}: {len(by_seq) - len(complete)} of {len(by_seq)} sequence numbers are missing "
                f"on some of ranks {sorted(ops_by_rank)}"
            )
        return [Collective(name, index, by_seq[seq]) for index, seq in enumerate(complete)]
    counts = {rank: len(ops) for rank, ops in ops_by_rank.items()}
    if len(set(counts.values())) != 1:
        unmatched.append(
            f"{label}: the ranks ran it a different number of times "
            f"({', '.join(f'rank {rank}: {count}' for rank, count in sorted(counts.items()))})"
        )
        return []
    (count,) = set(counts.values())
    return [Collective(name, index, {rank: ops[index] for rank, ops in ops_by_rank.items()}) for index in range(count)]


def match_collectives(ranks: list[RankTrace]) -> tuple[list[Collective], list[str]]:
    """(the collectives in start order, one line per op name left unmatched and why)."""
    grouped: dict[tuple[str | None, str], dict[int, list[Op]]] = {}
    for trace in ranks:
        for op in trace.ops:
            grouped.setdefault((op.group, op.name), {}).setdefault(trace.rank, []).append(op)
    collectives, unmatched = [], []
    for (group, name), ops_by_rank in sorted(grouped.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        if name in POINT_TO_POINT:
            continue
        if len(ops_by_rank) < len(ranks) and all(op.seq is None for ops in ops_by_rank.values() for op in ops):
            missing = sorted({trace.rank for trace in ranks} - set(ops_by_rank))
            unmatched.append(
                f"{name}: not run on rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} (a subgroup, or a profiler window that missed it)"
            )
            continue
        collectives += _collectives_of(name, group, ops_by_rank, unmatched)
    collectives.sort(key=lambda c: min(op.start_ns for op in c.ops.values()))
    return collectives, unmatched


def summarise(ranks: list[RankTrace], collectives: list[Collective]) -> list[RankSummary]:
    summaries = []
    for trace in ranks:
        joined = [c for c in collectives if trace.rank in c.ops]
        margins = [c.margin_ns for c in joined if c.last_rank == trace.rank]
        summaries.append(
            RankSummary(
                rank=trace.rank,
                collectives=len(joined),
                times_last=len(margins),
                mean_margin_ns=statistics.fmean(margins) if margins else 0.0,
                max_margin_ns=max(margins, default=0),
                total_margin_ns=sum(margins),
                waited_ns=sum(c.waited_ns(trace.rank) for c in joined),
            )
        )
    return summaries


def analyse(ranks: list[RankTrace]) -> Timeline:
    """The timeline of these ranks' ops: matched collectives, per-rank summaries, the straggler."""
    ranks = sorted(ranks, key=lambda trace: trace.rank)
    collectives, unmatched = match_collectives(ranks)
    return Timeline(ranks=ranks, collectives=collectives, summaries=summarise(ranks, collectives), unmatched=unmatched)
