"""A timeline of the backend's ops across ranks, and who held the others up (docs/observability.md).

    python -m torch_chainermn.timeline DIR -o timeline.png

reads DIR's per-rank profiler traces (torch.profiler's export_chrome_trace) or flight-recorder dumps
(torch's pickle format, one a rank) into a Timeline
(model.py: per rank, ops with their phases and times; stragglers.py: the collectives matched across
ranks, the rank that entered each last, a summary per rank) and draws it (drawing.py, matplotlib).
"""

from .folder import load, read_rank_files
from .model import Collective, Op, Phase, RankSummary, RankTrace, Timeline, TimelineError
from .stragglers import analyse

__all__ = [
    "load",
    "read_rank_files",
    "analyse",
    "draw",
    "Timeline",
    "RankTrace",
    "Op",
    "Phase",
    "Collective",
    "RankSummary",
    "TimelineError",
]


def draw(timeline, path, title=None):
    """Write `timeline`'s picture to `path` (PNG; needs matplotlib: the 'timeline' extra)."""
    from .drawing import draw as draw_png  # matplotlib only when a picture is asked for

    return draw_png(timeline, path, title)
