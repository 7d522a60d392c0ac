"""What the backend observed of a group's ops, beside torch's profiler (docs/observability.md):
who arrived last at recent collectives (`stragglers`), and what the ops moved and how long their
phases took (`counters`, `reset_counters`). Each reads this rank's view of one chainermn group."""

from __future__ import annotations

from . import _backend

# The counters' phases (csrc/phase.h), by the names this module gives them.
_PHASES = {
    "chainermn:within_node": "within_node",
    "chainermn:between_nodes": "between_nodes",
    "chainermn:encode": "encode",
    "chainermn:decode": "decode",
    "chainermn:wait_peers": "wait_peers",
    "chainermn:check": "check",
}
_CODED = ("encode", "decode")  # their bytes are a code's input and output
_TIMED_ONLY = ("wait_peers", "check")  # no transport or code, no bytes


def stragglers(group=None) -> dict:
    """Who arrived last at `group`'s recent collectives, and by how much (every rank sees the same).

    Returns {"window": collectives the summary covers, "margin_ms": the mean lateness that names a
    rank, "warn": whether rank 0 logs a line when one is named, "observed": collectives seen so far,
    "in_window": of them in the window, "straggler": the rank last in three quarters of the window by
    at least the margin on average (None if none), "ranks": {rank: {"node", "last": collectives of the
    window it arrived last at, "mean_ms", "max_ms": how long after every other rank it arrived}}}.
    Empty ("observed" 0) while the group's cross-rank checks are off (TORCH_DISTRIBUTED_DEBUG=OFF):
    the times ride in the checks' fingerprints.
    """
    window, margin_ms, warn, observed, in_window, named, ranks = _backend.backend_of(group, "stragglers").stragglers()
    return {
        "window": window,
        "margin_ms": margin_ms,
        "warn": warn,
        "observed": observed,
        "in_window": in_window,
        "straggler": named if named >= 0 else None,
        "ranks": {
            rank: {"node": node, "last": last, "mean_ms": mean_ms, "max_ms": max_ms}
            for rank, (node, last, mean_ms, max_ms) in enumerate(ranks)
        },
    }


def counters(group=None) -> dict:
    """What `group`'s ops moved on this rank, and how long their phases took, since the group began
    (or reset_counters()).

    Returns {"ops": ops run, "within_node": {transport: cell}, "between_nodes": {transport: cell},
    "encode": {code: cell}, "decode": {code: cell}, "wait_peers": cell, "check": cell}, with only the
    phases and transports that ran. A transport's cell is {"calls", "seconds", "bytes_sent",
    "bytes_received"} (what the call's algorithm moves, headers aside: docs/observability.md#counters);
    a code's {"calls", "seconds", "bytes_before", "bytes_after"} (encode: the float32 values, then the
    coded rows; decode: the reverse); wait_peers and check {"calls", "seconds"}. A phase's seconds
    include the phases inside it (the check's exchange is a transport's call).
    """
    ops, rows = _backend.backend_of(group, "counters").counters()
    result = {"ops": ops}
    for phase, what, calls, nanoseconds, out, into in rows:
        name = _PHASES[phase]
        cell = {"calls": calls, "seconds": nanoseconds / 1e9}
        if name in _TIMED_ONLY:
            result[name] = cell
            continue
        if name in _CODED:
            cell.update(bytes_before=into, bytes_after=out)
        else:
            cell.update(bytes_sent=out, bytes_received=into)
        result.setdefault(name, {})[what] = cell
    return result


def reset_counters(group=None) -> None:
    """Zeroes `group`'s counters on this rank (exact between ops; an op running meanwhile may count
    partly before and partly after)."""
    _backend.backend_of(group, "reset_counters").reset_counters()
