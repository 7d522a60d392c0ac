"""python -m torch_chainermn.timeline DIR [-o timeline.png]: the ranks' traces in DIR as a picture, and
the straggler analysis on stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import TimelineError, draw, load
from .text import report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_chainermn.timeline",
        description="Draw the backend's ops across ranks as a timeline (a row per rank, each op split into its "
        "phases, the rank that entered each collective last marked) from a folder of per-rank "
        "torch.profiler Chrome traces.",
    )
    parser.add_argument("folder", type=Path, help="one trace per rank (*.json or *.json.gz)")
    parser.add_argument("-o", "--output", type=Path, default=Path("timeline.png"), help="the PNG to write")
    parser.add_argument("--title", default=None, help="the picture's title (default: the straggler analysis)")
    parser.add_argument("--no-picture", action="store_true", help="print the analysis only (no matplotlib needed)")
    args = parser.parse_args(argv)
    try:
        timeline = load(args.folder)
        print(report(timeline))
        if not args.no_picture:
            print(f"wrote {draw(timeline, args.output, args.title)}")
    except (TimelineError, ModuleNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
