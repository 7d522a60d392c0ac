#!/usr/bin/env python
"""Pipelined micro-batches against the unpipelined chain: training-step throughput of a model split in
two stages over two processes, with torch.distributed.pipelining measured in the same run.

What is measured
----------------
Two stages of equal compute (each --depth Linear(--width, --width) + tanh layers), one per rank, a
batch of --batch samples, MSE loss on the last stage. A step is forward and backward of the whole
batch (gradients accumulate; no optimizer: it is the same for every contender). Each contender runs
--warmup steps, then --repeats timed loops of --steps steps, each loop started by a barrier; a loop's
time is the slowest rank's, and the step time is the median over the loops of (loop time / steps).
The contenders take turns loop by loop, so that a change in the machine's load hits them alike.

Contenders, on the same model and data:
  unpipelined          MultiNodeChainList(comm): chain(x), loss, backward (ChainerMN's behaviour:
                       rank 1 waits for rank 0's whole forward, rank 0 for rank 1's whole backward)
  chainermn GPipe      MultiNodeChainList(comm, micro_batches=M): chain(x) then one loss.backward()
  chainermn step GPipe chain.step(x, target=..., loss_fn=...) with schedule="gpipe"
  chainermn step 1F1B  the same with schedule="1f1b"
  ..., input gradients first  the same with input_gradients_first=True: the last stage sends its last
                       micro-batch's input gradients before it computes its weights' gradients
  torch GPipe (gloo)   torch.distributed.pipelining: PipelineStage + ScheduleGPipe on a gloo group
  torch 1F1B (gloo)    ... Schedule1F1B
The chainermn contenders run on the chainermn backend (MPI under mpiexec, Gloo under torchrun). The
ideal speedup of M micro-batches on 2 stages is 2M/(M+1) (1.78 for 8): the pipeline fills and drains
once per step. Every pipelined contender's gradients are checked against the unpipelined ones.

Micro-batches must stay big enough to compute as efficiently as the whole batch: with 32 rows of a
1024-wide layer, each micro-batch's weight gradient (a 4 MB GEMM of inner size 32, accumulated into
.grad) costs more than its share, and 8 micro-batches took 1.5-2x the time of one batch on one core.
Hence the defaults: micro-batches of 256 rows, where the split costs nothing. The script also
measures how fast two ranks compute at once on this machine (other work may hold the cores), which
bounds what any pipeline can gain.

Run it (2 ranks; one thread each, as the machine may have only 2 cores)
------
    torchrun --nproc-per-node 2 benchmarks/pipeline.py
    mpiexec --allow-run-as-root -n 2 .venv/bin/python benchmarks/pipeline.py --plot benchmarks/results/pipeline.png

Rank 0 prints a markdown table and, with --out (default benchmarks/results/pipeline.md), writes it
with a JSON of the rows next to it; --plot writes a bar chart if matplotlib is installed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import torch_chainermn  # noqa: E402  registers the backend (and reads MPI's ranks under mpiexec)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--width", type=int, default=512, help="features of every layer")
    parser.add_argument("--depth", type=int, default=4, help="Linear+tanh layers per stage")
    parser.add_argument("--batch", type=int, default=2048, help="samples per step")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (M)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per contender; the median is reported")
    parser.add_argument("--skip-torch", action="store_true", help="do not measure torch.distributed.pipelining")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results" / "pipeline.md",
        help="rank 0 writes the table here (and the rows as .json beside it)",
    )
    parser.add_argument("--plot", type=Path, help="write a bar chart of the throughputs here (needs matplotlib)")
    parser.add_argument(
        "--bind",
        action="store_true",
        help="bind each rank to core LOCAL_RANK first, as mpiexec does (torchrun does not)",
    )
    return parser.parse_args(argv)


class Stage(torch.nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, h):
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def timed(steps, args, group) -> list[float]:
    """Per step function: the median over loops of the slowest rank's time per step, in seconds. The
    contenders take turns loop by loop, so a change in the machine's load hits them all alike."""
    for step in steps:
        for _ in range(args.warmup):
            step()
    times = [[] for _ in steps]
    for _ in range(args.repeats):
        for step, mine in zip(steps, times):
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            elapsed = torch.tensor([(time.perf_counter() - start) / args.steps], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            mine.append(elapsed.item())
    return [statistics.median(t) for t in times]


def machine_concurrency(args, stage, x, group) -> float:
    """How much of its speed a stage keeps when both ranks compute at once: 1.0 on two free cores.
    Pipelining can only gain what the machine gives (the cores may be shared with other work)."""
    module = copy.deepcopy(stage)

    def compute():
        clear(module)
        module(x).sum().backward()

    compute()
    alone = []
    for turn in range(2):  # each rank alone, while the other waits at the barrier
        dist.barrier(group=group)
        if dist.get_rank() == turn:
            start = time.perf_counter()
            for _ in range(args.steps):
                compute()
            alone.append(time.perf_counter() - start)
        dist.barrier(group=group)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(args.steps):
        compute()
    together = torch.tensor([(time.perf_counter() - start) / alone[0]])
    dist.all_reduce(together, op=dist.ReduceOp.MAX, group=group)
    return 1.0 / together.item()


def clear(module):
    for p in module.parameters():
        p.grad = None


def chainermn_contenders(args, comm, stage, x, target):
    """(label, step function, module whose grads to check) for the chainermn contenders."""
    rank = comm.rank
    out = []
    m = args.micro_batches
    for label, m, schedule, use_step, first in [
        ("unpipelined", 1, "gpipe", False, False),
        ("chainermn GPipe (forward + backward)", m, "gpipe", False, False),
        ("chainermn step, GPipe", m, "gpipe", True, False),
        ("chainermn step, 1F1B", m, "1f1b", True, False),
        ("chainermn step, 1F1B, input gradients first", m, "1f1b", True, True),
    ]:
        module = copy.deepcopy(stage)
        chain = torch_chainermn.MultiNodeChainList(
            comm, micro_batches=m, schedule=schedule, input_gradients_first=first
        )
        chain.add_link(module, rank_in=None if rank == 0 else 0, rank_out=1 if rank == 0 else None)

        def step(chain=chain, module=module, use_step=use_step):
            clear(module)
            if use_step:
                chain.step(*((x,) if rank == 0 else ()), target=target if rank == 1 else None, loss_fn=F.mse_loss)
            elif rank == 0:
                chain(x).backward()
            else:
                F.mse_loss(chain(), target).backward()
            torch_chainermn.functions.drain(comm)  # the step is over when its messages have arrived

        out.append((label, step, module))
    return out


def torch_contenders(args, stage, x, target):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    out = []
    for label, cls in [("torch GPipe (gloo)", ScheduleGPipe), ("torch 1F1B (gloo)", Schedule1F1B)]:
        module = copy.deepcopy(stage)
        pipe_stage = PipelineStage(module, rank, 2, torch.device("cpu"), group=gloo)
        schedule = cls(pipe_stage, n_microbatches=args.micro_batches, loss_fn=F.mse_loss)

        def step(schedule=schedule, module=module):
            clear(module)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=target, losses=[])

        out.append((label, step, module))
    return out


def main():
    args = parse_args()
    if args.bind:
        os.sched_setaffinity(0, {(torch_chainermn._launch.record().local_rank or 0) % os.cpu_count()})
    torch.set_num_threads(1)  # two ranks on (maybe) two cores: one thread each
    dist.init_process_group("chainermn", timeout=datetime.timedelta(minutes=10))
    rank, size = dist.get_rank(), dist.get_world_size()
    if size != 2:
        raise SystemExit(f"run this on 2 ranks (one stage each), not {size}")
    comm = torch_chainermn.Communicator()
    torch.manual_seed(0)
    stages = [Stage(args.width, args.depth) for _ in range(2)]
    stage = stages[rank]
    x = torch.randn(args.batch, args.width)
    target = torch.randn(args.batch, args.width)

    concurrency = machine_concurrency(args, stage, x, comm.group)
    if rank == 0:
        print(f"two ranks computing at once run at {concurrency:.0%} of the speed of one alone", flush=True)
    contenders = chainermn_contenders(args, comm, stage, x, target)
    if not args.skip_torch:
        contenders += torch_contenders(args, stage, x, target)
    rows = []
    reference = None
    for (label, step, module), seconds in zip(contenders, timed([step for _, step, _ in contenders], args, comm.group)):
        grads = [p.grad for p in module.parameters()]  # of the last step
        if reference is None:
            reference = grads
        error = max((g - r).abs().max().item() / max(r.abs().max().item(), 1e-30) for g, r in zip(grads, reference))
        error = torch.tensor([error])
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        rows.append(
            {
                "contender": label,
                "step_ms": seconds * 1e3,
                "samples_per_s": args.batch / seconds,
                "grad_error": error.item(),
            }
        )
        if rank == 0:
            print(f"{label}: {seconds * 1e3:.1f} ms per step", flush=True)

    if rank == 0:
        args.concurrency = concurrency
        base = rows[0]["step_ms"]
        for row in rows:
            row["speedup"] = base / row["step_ms"]
        ideal = 2 * args.micro_batches / (args.micro_batches + 1)
        table = markdown(rows, args, ideal)
        print(table)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(table)
            args.out.with_suffix(".json").write_text(
                json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n"
            )
        if args.plot:
            plot(rows, args.plot, ideal)
    torch_chainermn.functions.drain()
    dist.destroy_process_group()


def markdown(rows, args, ideal) -> str:
    transport = torch_chainermn.transport()
    lines = [
        f"2 stages x {args.depth} Linear({args.width}, {args.width}) + tanh, batch {args.batch}, "
        f"{args.micro_batches} micro-batches, chainermn over {transport} (point to point within the node "
        f"through shared memory), ranks {'bound to cores' if args.bind or torch_chainermn._launch.record().launcher == 'mpiexec' else 'not bound'}; {platform.node()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, {datetime.date.today()}. "
        f"Ideal speedup 2M/(M+1) = {ideal:.2f}. Two ranks computing at once ran at "
        f"{args.concurrency:.0%} of one rank's speed alone (100%: two free cores).",
        "",
        "| contender | ms per step | samples/s | speedup | max rel. grad difference |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['contender']} | {row['step_ms']:.1f} | {row['samples_per_s']:.0f} | "
            f"{row['speedup']:.2f}x | {row['grad_error']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, path: Path, ideal: float) -> None:
    try:
        import matplotlib
    except ImportError:
        print(
            f"matplotlib is not installed, so no plot was written to {path} "
            f"(pip install matplotlib into this Python: {sys.executable})"
        )
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh([r["contender"] for r in rows][::-1], [r["speedup"] for r in rows][::-1], color="tab:blue")
    ax.axvline(ideal, color="tab:red", linestyle="--", label=f"ideal {ideal:.2f}x")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("throughput relative to the unpipelined chain")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
