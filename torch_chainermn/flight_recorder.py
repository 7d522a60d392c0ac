"""The backend's flight recorder: the last ops of every chainermn group in this process, in torch's format.

torch records nccl's and gloo's ops in its own FlightRecorder, which an extension cannot reach; chainermn
records its ops in a recorder of its own, with torch's settings and torch's dump format, so that torch's
tools read it (docs/observability.md):

- `TORCH_FR_BUFFER_SIZE` (legacy `TORCH_NCCL_TRACE_BUFFER_SIZE`): how many ops are kept, 2000 by default
  as in torch; 0 turns the recorder off.
- On a failure (an op's timeout, a dead or aborting peer, a mismatch the ranks' check finds) each rank
  writes its dump through torch's DebugInfoWriter before the op raises: to `TORCH_FR_DUMP_TEMP_FILE`
  (legacy `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`; torch 2.13 defaults to `~/.cache/torch/comm_lib_trace_rank_`)
  followed by the global rank.
  `TORCH_NCCL_DUMP_ON_TIMEOUT=0` turns that off.
- `python -m torch_chainermn.fr_trace DIR` is torch's analyzer (`torchfrtrace`), reading these dumps.

    import pickle, torch_chainermn
    trace = pickle.loads(torch_chainermn.flight_recorder.dump())   # as torch's _dump_fr_trace
    trace["entries"][-1]["profiling_name"], trace["entries"][-1]["state"]   # 'chainermn:all_reduce', 'completed'
"""

from __future__ import annotations

import json
import pickle

from . import _C

__all__ = ["dump", "dump_json", "enabled", "write"]


def dump(include_collectives: bool = True, include_stack_traces: bool = True, only_active: bool = False) -> bytes:
    """The recorder's dump as torch's `_dump_fr_trace` returns its own: pickled bytes of a dict with
    `version`, `pg_config`, `pg_status`, `comm_lib_version` and `entries` (one dict per op, oldest first).
    No stack is captured: with `include_stack_traces` each entry's `frames` is empty."""
    return _C.flight_recorder.dump(include_collectives, include_stack_traces, only_active)


def dump_json(include_collectives: bool = True, only_active: bool = False) -> str:
    """The same as JSON, in the form of torch's `_dump_fr_trace_json`: no `frames`, the discovery times 0
    when not reached, `pg_status`'s numbers as strings, no `entries` key when there is none."""
    trace = pickle.loads(dump(include_collectives, False, only_active))
    trace["pg_status"] = {
        pg: {key: str(value) for key, value in status.items()} for pg, status in trace["pg_status"].items()
    }
    entries = trace.pop("entries", [])
    for entry in entries:
        for key in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            if entry[key] is None:
                entry[key] = 0
    if entries:
        trace["entries"] = entries
    return json.dumps(trace)


def write(why: str = "requested") -> bool:
    """Writes the dump where torch writes a failure's (TORCH_FR_DUMP_TEMP_FILE + global rank), as the
    backend does on a failure; False when the recorder is off."""
    return _C.flight_recorder.write(why)


def enabled() -> bool:
    """Whether ops are recorded (TORCH_FR_BUFFER_SIZE is not 0)."""
    return _C.flight_recorder.enabled()
