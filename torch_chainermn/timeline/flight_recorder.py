"""One rank's ops from a flight-recorder dump in torch's format (the pickle torch's debug-info writer
writes to $TORCH_FR_DUMP_TEMP_FILE<rank>, or `torch._C._distributed_c10d._dump_fr_trace()` returns).

As torch's analyzer (torch/distributed/flight_recorder/components/loader.py) does, the rank is the
number the file's name ends with: the dump itself does not hold it. Each entry is one op: its group
(`process_group`'s name), its sequence number in that group (`collective_seq_id`; `p2p_seq_id` for
point-to-point), its name (`profiling_name`, "gloo:all_reduce", "chainermn:send 0->1": the word
after the backend's prefix), and times on the machine's wall clock in nanoseconds: created (the
rank posted the op: it entered it), and, where the backend found them, started and completed. An
entry that never completed (or whose backend does not say: torch 2.13's gloo leaves every entry
"scheduled") has no end: it is drawn as a tick at its start. A dump keeps no phases.

A pickle can run code when it is read: read only dumps you trust (torch's analyzer reads them so too).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

from .model import Op, RankTrace, TimelineError

RANK_AT_END = re.compile(r"(\d+)$")


def is_flight_recorder_dump(path: Path) -> bool:
    """torch's dump file names: a prefix and the rank, no extension."""
    return RANK_AT_END.search(path.name) is not None


def _op_of(entry: dict, path: Path) -> Op:
    try:
        name = str(entry["profiling_name"]).partition(":")[2].split(" ")[0] or str(entry["profiling_name"])
        created = int(entry["time_created_ns"])
        completed = entry.get("time_discovered_completed_ns")
        group = entry.get("process_group")
        group = str(group[0]) if isinstance(group, (tuple, list)) and group else str(entry.get("pg_id"))
        seq = entry["p2p_seq_id"] if entry.get("is_p2p") else entry["collective_seq_id"]
    except (KeyError, TypeError, ValueError) as error:
        shown = {k: v for k, v in entry.items() if k != "frames"} if isinstance(entry, dict) else entry
        raise TimelineError(
            f"{path}: a flight-recorder entry lacks a field torch's format has ({error!r}): {shown!r}"
        ) from error
    return Op(
        name=name,
        start_ns=created,
        end_ns=int(completed) if completed else created,
        thread=str(entry.get("thread_name") or entry.get("thread_id") or "?"),
        group=group,
        seq=int(seq),
        completed=bool(completed),
    )


def read_flight_recorder_dump(path: Path) -> RankTrace:
    rank = int(RANK_AT_END.search(path.name).group(1))
    try:
        with open(path, "rb") as f:
            dump = pickle.load(f)
    except Exception as error:  # noqa: BLE001  any unpickling failure means: not a dump
        raise TimelineError(
            f"{path}: not a flight-recorder dump (torch's pickle): {type(error).__name__}: {error}"
        ) from error
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise TimelineError(
            f"{path}: not a flight-recorder dump: no 'entries' list (torch's format has "
            f"version, pg_config, pg_status, entries)"
        )
    if not dump["entries"]:
        raise TimelineError(
            f"{path}: rank {rank}'s flight-recorder dump has no entries: did the recorder run "
            f"(TORCH_FR_BUFFER_SIZE > 0)?"
        )
    ops = sorted((_op_of(entry, path) for entry in dump["entries"]), key=lambda op: op.start_ns)
    return RankTrace(rank=rank, source=str(path), ops=ops)
