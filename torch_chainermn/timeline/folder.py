"""A folder of per-rank files into one Timeline: every file one rank's, each rank once, one kind of file
(profiler traces or flight-recorder dumps) per folder."""

from __future__ import annotations

from pathlib import Path

from .flight_recorder import is_flight_recorder_dump, read_flight_recorder_dump
from .model import RankTrace, Timeline, TimelineError
from .profiler_traces import is_profiler_trace, read_profiler_trace
from .stragglers import analyse


def read_rank_files(folder: Path) -> list[RankTrace]:
    folder = Path(folder)
    if not folder.is_dir():
        raise TimelineError(f"{folder}: no such folder")
    files = sorted(path for path in folder.iterdir() if path.is_file())
    traces = [path for path in files if is_profiler_trace(path)]
    dumps = [path for path in files if not is_profiler_trace(path) and is_flight_recorder_dump(path)]
    if traces and dumps:
        raise TimelineError(
            f"{folder}: holds both profiler traces ({traces[0].name}, ...) and flight-recorder dumps "
            f"({dumps[0].name}, ...): one kind per folder"
        )
    if not traces and not dumps:
        raise TimelineError(
            f"{folder}: no profiler trace in it (*.json or *.json.gz, one a rank, as torch.profiler's "
            f"export_chrome_trace writes them) and no flight-recorder dump (a file name ending in "
            f"the rank, as torch's TORCH_FR_DUMP_TEMP_FILE<rank>)"
        )
    read = read_profiler_trace if traces else read_flight_recorder_dump
    by_rank: dict[int, RankTrace] = {}
    for path in traces or dumps:
        trace = read(path)
        if trace.rank in by_rank:
            raise TimelineError(
                f"{folder}: two files of rank {trace.rank} ({by_rank[trace.rank].source} and "
                f"{path}): keep one run's files in a folder"
            )
        by_rank[trace.rank] = trace
    return [by_rank[rank] for rank in sorted(by_rank)]


def load(folder: Path) -> Timeline:
    """The timeline of the ranks whose files are in `folder` (raises TimelineError, naming the file)."""
    return analyse(read_rank_files(folder))
