"""The table of bad inputs in docs/benchmarks.md: every case of tests/support/mismatch_cases.py on chainermn and on gloo.

    .venv/bin/python tools/bad_inputs.py [--ranks 2] [--out bad_inputs.md]

chainermn runs the whole battery in one job on one group (as the tests do). gloo runs each case in a
job of its own with a 3 s timeout, because a mismatch can leave a gloo group unusable or abort the
process. Each cell says what the ranks got: "error" (every rank raised), "error on r" (only those
ranks raised; the others returned), "silent" (no rank raised), "timeout", or "crash", and marks
outputs that were written and a next all_reduce that was wrong.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.harness import RankFailure, run_spawn  # noqa: E402
from tests.support.mismatch_cases import CASES, POINT_TO_POINT, run_battery  # noqa: E402


def gloo_case(name: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    return run_battery([name])[name]


def chainermn_battery():
    return run_battery()


def describe(name: str, per_rank: list) -> str:
    concerned = [1] if name in POINT_TO_POINT else list(range(len(per_rank)))
    raised = [r for r, got in enumerate(per_rank) if got["got"] != "silent"]
    timeouts = [r for r, got in enumerate(per_rank) if "timed out" in got["got"].lower()]
    if timeouts and len(timeouts) == len(raised):
        cell = "timeout"
    elif all(r in raised for r in concerned):
        cell = "error"
    elif raised:
        cell = "error on " + ",".join(map(str, raised)) + ", silent elsewhere"
    else:
        cell = "**silent**"
    if not all(got["untouched"] for got in per_rank):
        cell += ", **output written**"
    if not all(got["in_step"] for got in per_rank):
        cell += ", next call wrong/failed"
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    ours = run_spawn(chainermn_battery, args.ranks, timeout=600, op_timeout=20)
    rows = []
    for index, name in enumerate(CASES, 1):
        try:
            theirs = describe(name, run_spawn(gloo_case, args.ranks, name, init=False, timeout=60))
        except RankFailure as failure:
            theirs = "crash" if "died" in str(failure) else "hang"
        mine = describe(name, [ours[r][name] for r in range(args.ranks)])
        rows.append(f"| {index} | {name} | {mine} | {theirs} |")
        print(rows[-1], flush=True)
    errors = sum(1 for row in rows if row.split("|")[3].strip().startswith("error"))
    table = "\n".join(
        [
            f"{len(rows)} bad inputs, {args.ranks} ranks on one machine, {datetime.date.today()}: chainermn raised on "
            f"every rank concerned in {errors} of {len(rows)}.",
            "",
            "| # | call (rank 1 differs) | chainermn | gloo |",
            "| ---: | --- | --- | --- |",
            *rows,
        ]
    )
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
