#!/usr/bin/env python
"""What seeing the backend through torch's tools costs an all_reduce (docs/observability.md).

One launch (2 ranks, torchrun) times back-to-back blocking all_reduces of --bytes float32 on the
default chainermn group: --loops loops of --iters ops, each loop after a barrier; a loop's time per op
is the slowest rank's; the launch prints the loops' median in microseconds. With --profile each loop
runs inside torch.profiler.profile(activities=[CPU]) (a profiler of its own per loop, so its buffers
do not grow across loops).

The driver (--rounds N) interleaves launches of several contenders, round after round, so that a drift
of this shared machine reaches them all alike, and prints each contender's launches (min / median /
max of their medians). A contender is LABEL=PYTHON[,VAR=VALUE...]: the interpreter of a venv (its
torch_chainermn: a build before a change, or after) and the environment of its launches (`backend=gloo`
among them runs torch's gloo instead of chainermn, for the same table), e.g.

    .venv/bin/python benchmarks/observability_cost.py --rounds 5 \\
        before=/work/main/.venv/bin/python after=.venv/bin/python
    .venv/bin/python benchmarks/observability_cost.py --rounds 5 --profile \\
        before=/work/main/.venv/bin/python after=.venv/bin/python
    .venv/bin/python benchmarks/observability_cost.py --rounds 5 \\
        recorder-off=.venv/bin/python,TORCH_FR_BUFFER_SIZE=0 recorder-on=.venv/bin/python \
        gloo=.venv/bin/python,backend=gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("contenders", nargs="*", help="LABEL=PYTHON[,VAR=VALUE...] (driver only)")
    parser.add_argument("--bytes", type=int, default=4096, help="message size (float32)")
    parser.add_argument("--iters", type=int, default=2000, help="all_reduces per loop")
    parser.add_argument("--loops", type=int, default=7, help="timed loops per launch; their median is reported")
    parser.add_argument("--profile", action="store_true", help="each loop inside torch.profiler.profile")
    parser.add_argument("--rounds", type=int, default=0, help="driver: rounds of one launch per contender")
    parser.add_argument("--backend", default="chainermn", help="the default group's backend (one launch)")
    parser.add_argument(
        "--recorder-cost",
        action="store_true",
        help="the flight recorder's own time per op, in process (a test build's _C.testing)",
    )
    parser.add_argument(
        "--ranks", type=int, default=2, help="driver: ranks per launch (1: the posting path alone, no peer to wait for)"
    )
    return parser.parse_args(argv)


def one_launch(args):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import torch_chainermn  # noqa: F401  (registers the backend)

    dist.init_process_group(args.backend)
    x = torch.ones(args.bytes // 4)
    for _ in range(200):
        dist.all_reduce(x)
    per_op = []
    for _ in range(args.loops):
        dist.barrier()
        if args.profile:
            with profile(activities=[ProfilerActivity.CPU]):
                start = time.perf_counter()
                for _ in range(args.iters):
                    dist.all_reduce(x)
                elapsed = time.perf_counter() - start
        else:
            start = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(x)
            elapsed = time.perf_counter() - start
        slowest = torch.tensor([elapsed / args.iters * 1e6], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        per_op.append(slowest.item())
    if dist.get_rank() == 0:
        print(json.dumps({"median_us": statistics.median(per_op), "loops_us": per_op}), flush=True)
    dist.destroy_process_group()


def drive(args):
    contenders = []
    for spec in args.contenders:
        label, _, rest = spec.partition("=")
        python, *settings = rest.split(",")
        contenders.append((label, python, dict(s.split("=", 1) for s in settings)))
    backends = {label: settings.pop("backend", "chainermn") for label, _, settings in contenders}
    flags = ["--bytes", str(args.bytes), "--iters", str(args.iters), "--loops", str(args.loops)]
    flags += ["--profile"] if args.profile else []
    results = {label: [] for label, _, _ in contenders}
    for round_ in range(args.rounds):
        order = contenders[round_ % len(contenders) :] + contenders[: round_ % len(contenders)]
        for label, python, settings in order:
            command = [
                python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(args.ranks),
                str(Path(__file__).resolve()),
                *flags,
                "--backend",
                backends[label],
            ]
            # Outside the repository: `import torch_chainermn` finds the venv's own build.
            done = subprocess.run(
                command, env={**os.environ, **settings}, cwd="/tmp", capture_output=True, text=True, timeout=600
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                sys.exit(f"{label}: launch failed ({done.returncode})\n{done.stderr[-3000:]}")
            results[label].append(json.loads(lines[-1])["median_us"])
            print(f"round {round_ + 1} {label}: {results[label][-1]:.2f} us", flush=True)
    print(
        f"\n{args.bytes} B all_reduce, {args.ranks} rank(s), {'profiler on' if args.profile else 'profiler off'}, "
        f"{args.rounds} launches each (min / median / max of the launches' medians, us per op):"
    )
    for label, values in results.items():
        print(f"  {label:>14}: {min(values):7.2f} / {statistics.median(values):7.2f} / {max(values):7.2f}")


def recorder_cost(args):
    """The flight recorder's own work per op (record, start, end of a 4 KiB all_reduce), timed in C++ on a
    ring of torch's default size, against the op times above."""
    import torch

    from torch_chainermn._C import testing

    ring = testing.FlightRecorderRing(2000, [0, 1], 0, "0", "default_pg")
    x = torch.ones(args.bytes // 4)
    ring.nanoseconds_per_op(x, 10000)  # every slot written once: no allocation from here on
    runs = [ring.nanoseconds_per_op(x, 200000) for _ in range(7)]
    print(
        f"flight recorder, {args.bytes} B all_reduce: {min(runs):.0f} / {statistics.median(runs):.0f} / "
        f"{max(runs):.0f} ns per op (min / median / max of 7 runs of 200000)"
    )


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.recorder_cost:
        recorder_cost(arguments)
    elif arguments.rounds:
        drive(arguments)
    else:
        one_launch(arguments)
