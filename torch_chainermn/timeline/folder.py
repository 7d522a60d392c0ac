"""A folder of per-rank files into one Timeline: every file one rank's, each rank once."""
from __future__ import annotations

from pathlib import Path

from .model import RankTrace, Timeline, TimelineError
from .profiler_traces import is_profiler_trace, read_profiler_trace
from .stragglers import analyse


def read_rank_files(folder: Path) -> list[RankTrace]:
    folder = Path(folder)
    if not folder.is_dir():
        raise TimelineError(f"{folder}: no such folder")
    files = sorted(path for path in folder.iterdir() if path.is_file() and is_profiler_trace(path))
    if not files:
        raise TimelineError(f"{folder}: no profiler trace in it (*.json or *.json.gz, one a rank, as "
                            f"torch.profiler's export_chrome_trace writes them)")
    by_rank: dict[int, RankTrace] = {}
    for path in files:
        trace = read_profiler_trace(path)
        if trace.rank in by_rank:
            raise TimelineError(f"{folder}: two files of rank {trace.rank} ({by_rank[trace.rank].source} and "
                                f"{path}): keep one run's files in a folder")
        by_rank[trace.rank] = trace
    return [by_rank[rank] for rank in sorted(by_rank)]


def load(folder: Path) -> Timeline:
    """The timeline of the ranks whose files are in `folder` (raises TimelineError, naming the file)."""
    return analyse(read_rank_files(folder))
