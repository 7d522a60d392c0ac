"""One rank's ops from the Chrome trace torch's profiler writes (`prof.export_chrome_trace(path)`).

The trace names the rank (`distributedInfo.rank`, present when the process group was up while the
profiler ran) and its host. Each span is a complete event ("ph": "X") whose `ts` and `dur` are
microseconds; `ts` counts from the trace's `baseTimeNanoseconds`, so base + ts is the machine's wall
clock (model.py says what that means across machines). The backend's ops are the spans named
"chainermn:<op>", its phases the child spans named in PHASES (docs/observability.md), found on the
op's own thread within the op's time.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from .model import Op, Phase, RankTrace, TimelineError

PREFIX = "chainermn:"
PHASES = ("within_node", "between_nodes", "encode", "decode", "wait_peers", "check")


def is_profiler_trace(path: Path) -> bool:
    return path.name.endswith((".json", ".json.gz"))


def _load(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TimelineError(f"{path}: not a readable profiler trace (JSON): {error}") from error
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TimelineError(
            f"{path}: no 'traceEvents' list: not a Chrome trace of torch.profiler (prof.export_chrome_trace)"
        )
    return trace


def _rank_of(trace: dict, path: Path) -> int:
    rank = (trace.get("distributedInfo") or {}).get("rank")
    if not isinstance(rank, int):
        raise TimelineError(
            f"{path}: the trace names no rank (its distributedInfo.rank): export it from a "
            f"process whose process group was initialised while the profiler ran"
        )
    return rank


def _span(event: dict, base_ns: int) -> tuple[int, int]:
    start = base_ns + round(float(event["ts"]) * 1000)
    return start, start + round(float(event.get("dur", 0)) * 1000)


def read_profiler_trace(path: Path) -> RankTrace:
    trace = _load(path)
    rank = _rank_of(trace, path)
    base_ns = int(trace.get("baseTimeNanoseconds", 0))
    threads = {}  # (pid, tid) -> the thread's name in the trace's metadata
    spans = []  # (start, end, thread key, name without the prefix, args)
    for event in trace["traceEvents"]:
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event.get("pid"), event.get("tid"))] = (event.get("args") or {}).get("name", "")
        name = str(event.get("name", ""))
        if event.get("ph") == "X" and name.startswith(PREFIX):
            try:
                start, end = _span(event, base_ns)
            except (KeyError, TypeError, ValueError) as error:
                raise TimelineError(f"{path}: the span {event!r} has no usable ts/dur: {error}") from error
            thread = (event.get("pid"), event.get("tid"))
            spans.append((start, end, thread, name[len(PREFIX) :], event.get("args") or {}))
    if not spans:
        raise TimelineError(
            f"{path}: rank {rank}'s trace holds no chainermn span: was the profiler on while the "
            f"backend ran ops (docs/observability.md)?"
        )
    # Longest first at equal starts, so that an op comes before the phases it holds.
    spans.sort(key=lambda s: (s[0], -s[1]))
    ops = []
    open_ops = {}  # thread key -> the op that thread is running at this point of the walk
    open_phases = {}  # thread key -> the phases (outermost first) that enclose this point
    for start, end, key, name, args in spans:
        current = open_ops.get(key)
        inside = current is not None and start < current.end_ns and end <= current.end_ns
        if name in PHASES:
            if not inside:
                continue  # a phase outside any op (none is expected): nothing to attach it to
            enclosing = [p for p in open_phases.get(key, []) if start < p.end_ns and end <= p.end_ns]
            phase = Phase(name, start, end, what=args.get("what"), bytes=args.get("bytes"), depth=len(enclosing))
            open_phases[key] = enclosing + [phase]
            current.phases.append(phase)
        elif inside:
            # An op started inside another on the same thread (one op built on another): drawn as a
            # part of the outer op, left out of the matching across ranks.
            current.phases.append(Phase(name, start, end, depth=0))
        else:
            op = Op(name, start, end, thread=threads.get(key, f"thread {key[1]}"))
            open_ops[key] = op
            open_phases[key] = []
            ops.append(op)
    if not ops:
        raise TimelineError(
            f"{path}: rank {rank}'s trace holds phases of the backend but no op span "
            f"(chainermn:<op>) around them: not a trace torch.profiler wrote of this backend"
        )
    return RankTrace(rank=rank, source=str(path), host=trace.get("host_name"), ops=ops)
