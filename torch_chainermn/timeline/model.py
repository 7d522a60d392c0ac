"""What the timeline holds: per rank, the backend's ops with their phases and times.

Every time is in nanoseconds on the clock of the rank's machine (the Unix epoch, as torch's profiler
and flight recorder take it): ranks on one machine share it; ranks on different machines are as far
apart as their clocks (NTP keeps them within about a millisecond on a LAN, PTP within microseconds),
and that error adds to every lateness measured between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class TimelineError(ValueError):
    """A folder, trace or dump that cannot make a timeline; the message says which file and why."""


@dataclass
class Phase:
    """A part of an op (docs/observability.md): `name` without the "chainermn:" prefix
    ("within_node", "between_nodes", "encode", "decode", "wait_peers", "check")."""

    name: str
    start_ns: int
    end_ns: int
    what: str | None = None  # the transport ("shm", "gloo", "mpi") or the code ("int8")
    bytes: int | None = None  # this rank's buffer handed to the transport or code
    depth: int = 0  # 0: directly inside the op; 1: inside another phase (the check's exchange)


@dataclass
class Op:
    """One op of the backend on one rank, from the moment the rank entered it to its completion: in a
    profiler trace, when a thread started running it; in a flight-recorder dump, when it was posted."""

    name: str  # torch's op name without the prefix: "all_reduce", "barrier", "send"
    start_ns: int
    end_ns: int
    thread: str  # the thread that ran it (the caller's or the group's worker)
    phases: list[Phase] = field(default_factory=list)
    group: str | None = None  # the process group, where the source names it (a flight-recorder dump)
    seq: int | None = None  # the op's sequence number in its group, where the source has it
    completed: bool = True  # False: the source knows no end (a flight-recorder entry never seen to complete)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class RankTrace:
    """One rank's ops, in start order, as read from one file (a profiler trace or a flight-recorder dump)."""

    rank: int
    source: str  # the file read
    host: str | None = None
    ops: list[Op] = field(default_factory=list)


@dataclass
class Collective:
    """One collective as every rank ran it, matched across the ranks (stragglers.py)."""

    name: str
    index: int  # this is the index-th op of its name (and group) on every rank, from 0
    ops: dict[int, Op]  # rank -> that rank's op

    @property
    def last_rank(self) -> int:
        """The rank that entered last (everybody else waited for it)."""
        return max(self.ops, key=lambda rank: self.ops[rank].start_ns)

    @property
    def margin_ns(self) -> int:
        """How much later than every other rank the last one entered: the least any rank waited for it."""
        starts = sorted(op.start_ns for op in self.ops.values())
        return starts[-1] - starts[-2] if len(starts) > 1 else 0

    def waited_ns(self, rank: int) -> int:
        """How long `rank` had to wait, at least, for the last rank to enter."""
        return self.ops[self.last_rank].start_ns - self.ops[rank].start_ns


@dataclass
class RankSummary:
    """One rank over every matched collective."""

    rank: int
    collectives: int  # the matched collectives this rank took part in
    times_last: int  # in how many of them it entered last
    mean_margin_ns: float  # when last: by how much, on average (Collective.margin_ns)
    max_margin_ns: int
    total_margin_ns: int  # its margins summed: the time it held the others up, at least
    waited_ns: int  # the time it spent waiting for the last rank of each collective, summed


@dataclass
class Timeline:
    """Every rank's ops, the collectives matched across them and who held them up."""

    ranks: list[RankTrace]  # by rank
    collectives: list[Collective]
    summaries: list[RankSummary]  # by rank
    unmatched: list[str]  # why some ops took no part in the straggler analysis, one line per name

    @property
    def straggler(self) -> int | None:
        """The rank that held the others up longest: the largest margins summed over the collectives it
        entered last (a rank last by microseconds in many ops is noise, one last by milliseconds is
        not); None when no collective was matched."""
        if not self.collectives:
            return None
        return max(self.summaries, key=lambda s: (s.total_margin_ns, s.times_last)).rank
