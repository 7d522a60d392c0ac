#!/usr/bin/env python
"""Memory soak: every collective, random sizes, groups created and destroyed; each rank's RSS over time.

What it does
------------
Every rank draws the same sequence of operations from one seed: all_reduce (SUM, AVG, MAX),
broadcast, reduce, all_gather, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single,
gather, scatter, send/recv between pairs, barrier, all_reduce of a sparse tensor, torch_chainermn's
mean_coalesced and an object collective, on float32, float16, bfloat16 and int64 tensors of
random sizes (log-uniform from 1 element to --max-bytes). Every --group-every operations a new group
is created (a random strategy, shared memory on or off), used for a few operations and destroyed.
Every result is checked (a few elements of it, against what the op must give); a wrong one stops
the run with the op and the rank.

RSS (VmRSS of /proc/self/status) is sampled on every rank every --sample-every operations. The
table gives each rank's RSS at the start, after --warmup operations, half-way and at the end, with
the growth over the second half: a leak grows in proportion to the ops run, a cache levels off (the
allocator's free lists and the groups' staging buffers grow until the sizes drawn stop setting new
highs). --trim samples after malloc_trim(0), so that what glibc keeps cached is left out.

Run it (2 ranks; the same script on gloo for comparison)
------
    .venv/bin/torchrun --nproc-per-node 2 benchmarks/soak.py --ops 100000
    .venv/bin/torchrun --nproc-per-node 2 benchmarks/soak.py --ops 100000 --backend gloo
    mpiexec --allow-run-as-root -n 2 .venv/bin/python benchmarks/soak.py --ops 100000

Rank 0 prints a markdown table and writes it, with the samples as JSON, to --out (default
benchmarks/results/soak-<backend>.md); --plot writes the RSS curves as a PNG (needs matplotlib).
It exits 1 if any result was wrong.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import torch_chainermn  # noqa: E402  registers the backend (and reads MPI's ranks under mpiexec)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]
STRATEGIES = ["naive", "flat", "hierarchical", "two_dimensional", "single_node"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=100_000, help="operations in all (default 100000)")
    p.add_argument("--warmup", type=int, default=None, help="operations before the warm RSS (default ops/10)")
    p.add_argument("--sample-every", type=int, default=None, help="operations between RSS samples (default ops/50)")
    p.add_argument("--group-every", type=int, default=2000, help="operations between group creations")
    p.add_argument("--max-bytes", type=int, default=4 << 20, help="largest tensor, in bytes (default 4 MiB)")
    p.add_argument("--backend", default="chainermn", help="chainermn (default) or gloo, for comparison")
    p.add_argument(
        "--trim",
        action="store_true",
        help="sample RSS after malloc_trim(0): the memory in use, without the allocator's cache",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="markdown table (and .json beside it)")
    p.add_argument("--plot", type=Path, default=None, help="PNG of the RSS curves (needs matplotlib)")
    args = p.parse_args(argv)
    args.warmup = args.ops // 10 if args.warmup is None else args.warmup
    args.sample_every = max(1, args.ops // 50) if args.sample_every is None else args.sample_every
    if args.out is None:
        args.out = REPO / "benchmarks" / "results" / f"soak-{args.backend}{'-trim' if args.trim else ''}.md"
    return args


def trimmed_rss_mib() -> float:
    """RSS after glibc's malloc_trim(0) hands freed heap pages back: the memory still in use, whatever
    the allocator keeps cached (what a leak would grow)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mib()


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class WrongResult(RuntimeError):
    pass


def expect(op: str, got: torch.Tensor, want, dtype) -> None:
    """`got` (a few elements of a result) equals `want` exactly: every value sent is a small integer, so
    every result is exact in every dtype (a floating AVG's `want` is already rounded to the dtype)."""
    want = torch.as_tensor(want, dtype=torch.float64).reshape(-1)
    got = got.reshape(-1).to(torch.float64)
    if got.shape != want.shape or not torch.equal(got, want):
        raise WrongResult(f"{op} ({dtype}) on rank {dist.get_rank()}: got {got.tolist()[:4]}, want {want.tolist()[:4]}")


def ends(t: torch.Tensor) -> torch.Tensor:
    """The first and last element: what is checked of a result (checking all would dominate the run)."""
    flat = t.reshape(-1)
    return torch.stack([flat[0], flat[-1]])


def to_global(group, rank: int) -> int:
    """`group`'s rank `rank` as the rank torch.distributed's src/dst arguments take (None: the world)."""
    return dist.get_global_rank(group, rank) if group else rank


def one_op(rng: random.Random, group, args, rank: int, size: int) -> str:
    """Run one random operation on `group`; every rank draws the same choices. Returns its name."""
    dtype = rng.choice(DTYPES)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = max(size, int(math.exp(rng.uniform(0, math.log(args.max_bytes // itemsize)))))
    n -= n % size  # divisible by the group's size, for the ops that split a tensor in equal parts
    root = rng.randrange(size)
    op = rng.choice(
        [
            "all_reduce",
            "all_reduce_avg",
            "all_reduce_max",
            "broadcast",
            "reduce",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_to_all_single",
            "gather",
            "scatter",
            "send_recv",
            "barrier",
            "sparse",
            "mean_coalesced",
            "object",
        ]
    )
    mine = torch.full((n,), rank + 1, dtype=dtype)
    total = size * (size + 1) // 2
    if op == "all_reduce":
        dist.all_reduce(mine, group=group)
        expect(op, ends(mine), [total, total], dtype)
    elif op == "all_reduce_avg" and dtype == torch.int64 and args.backend == "gloo":
        dist.all_reduce(mine, group=group)  # gloo refuses integer AVG (chainermn divides as NCCL does)
        expect(op, ends(mine), [total, total], dtype)
    elif op == "all_reduce_avg":
        if dtype == torch.int64:
            mine.mul_(size)  # an exact integer mean
        dist.all_reduce(mine, op=dist.ReduceOp.AVG, group=group)
        want = total if dtype == torch.int64 else total / size
        if dtype in (torch.float16, torch.bfloat16) or want != int(want):
            want = float(torch.tensor(want, dtype=dtype))  # the dtype's rounding of the mean
        expect(op, ends(mine), [want, want], dtype)
    elif op == "all_reduce_max":
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        expect(op, ends(mine), [size, size], dtype)
    elif op == "broadcast":
        dist.broadcast(mine, src=to_global(group, root), group=group)
        expect(op, ends(mine), [root + 1] * 2, dtype)
    elif op == "reduce":
        dist.reduce(mine, dst=to_global(group, root), group=group)
        if rank == root:
            expect(op, ends(mine), [total, total], dtype)
    elif op == "all_gather":
        out = [torch.empty(n // size, dtype=dtype) for _ in range(size)]
        dist.all_gather(out, mine[: n // size], group=group)
        expect(op, torch.stack([o[-1] for o in out]), list(range(1, size + 1)), dtype)
    elif op == "all_gather_into_tensor":
        out = torch.empty(n, dtype=dtype)
        dist.all_gather_into_tensor(out, mine[: n // size], group=group)
        expect(op, ends(out), [1, size], dtype)
    elif op == "reduce_scatter_tensor":
        out = torch.empty(n // size, dtype=dtype)
        dist.reduce_scatter_tensor(out, mine, group=group)
        expect(op, ends(out), [total, total], dtype)
    elif op == "all_to_all_single":
        out = torch.empty(n, dtype=dtype)
        dist.all_to_all_single(out, mine, group=group)
        expect(op, ends(out), [1, size], dtype)
    elif op == "gather":
        out = [torch.empty(n // size, dtype=dtype) for _ in range(size)] if rank == root else None
        dist.gather(mine[: n // size], out, dst=to_global(group, root), group=group)
        if rank == root:
            expect(op, torch.stack([o[0] for o in out]), list(range(1, size + 1)), dtype)
    elif op == "scatter":
        parts = [torch.full((n // size,), r + 1, dtype=dtype) for r in range(size)] if rank == root else None
        out = torch.empty(n // size, dtype=dtype)
        dist.scatter(out, parts, src=to_global(group, root), group=group)
        expect(op, ends(out), [rank + 1] * 2, dtype)
    elif op == "send_recv":
        # Pairs (0,1), (2,3), ...: the even rank sends, the odd one receives; an odd rank out waits.
        peer = rank ^ 1
        if peer < size:
            to = to_global(group, peer)
            if rank % 2 == 0:
                dist.send(mine, dst=to, group=group)
            else:
                dist.recv(mine, src=to, group=group)
                expect(op, ends(mine), [peer + 1] * 2, dtype)
    elif op == "barrier":
        dist.barrier(group=group)
    elif op == "sparse":
        rows = max(2, min(n, 4096))
        indices = torch.tensor([[0, rows - 1]])
        sparse = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0]), (rows,))
        dist.all_reduce(sparse, group=group)
        dense = sparse.to_dense()
        expect(op, dense[-1:], [2.0 * size], torch.float32)
    elif op == "mean_coalesced":
        if args.backend != "chainermn":
            dist.all_reduce(mine, group=group)  # gloo's nearest: a plain all_reduce
        else:
            grads = [torch.full((max(1, n // 3),), float(rank + 1)), torch.full((7,), float(rank + 1))]
            torch_chainermn.mean_coalesced(grads, group=group)
            expect(op, torch.stack([grads[0][-1], grads[1][0]]), [total / size] * 2, torch.float32)
    elif op == "object":
        objects = [{"rank": rank, "payload": list(range(rng.randrange(100)))}]
        dist.broadcast_object_list(objects, src=to_global(group, root), group=group)
        if objects[0]["rank"] != root:
            raise WrongResult(f"broadcast_object_list on rank {rank}: got rank {objects[0]['rank']}'s object")
    return op


def new_group(rng: random.Random, args):
    """A group over every rank with a random strategy and shared memory on or off (chainermn)."""
    if args.backend != "chainermn":
        return dist.new_group(backend=args.backend)
    options = torch_chainermn.Options(communicator=rng.choice(STRATEGIES), shared_memory=rng.random() < 0.5)
    return dist.new_group(backend="chainermn", pg_options=options)


def soak(args) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    rng = random.Random(args.seed)
    dist.barrier()
    measure = trimmed_rss_mib if args.trim else rss_mib
    samples = [(0, measure())]
    counts: dict[str, int] = {}
    started = time.perf_counter()
    for i in range(1, args.ops + 1):
        if i % args.group_every == 0:
            group = new_group(rng, args)
            for _ in range(8):
                one_op(rng, group, args, rank, size)
            dist.destroy_process_group(group)
        name = one_op(rng, None, args, rank, size)
        counts[name] = counts.get(name, 0) + 1
        if i % args.sample_every == 0 or i in (args.warmup, args.ops // 2, args.ops):
            samples.append((i, measure()))
    seconds = time.perf_counter() - started
    every = [None] * size
    dist.all_gather_object(every, samples)
    return {"samples": every, "counts": counts, "seconds": seconds}


def at(samples: list, op: int) -> float:
    return next(rss for i, rss in samples if i >= op)


def table(result: dict, args) -> str:
    what = "RSS after malloc_trim(0)" if args.trim else "RSS"
    lines = [
        f"Memory soak ({what}), {args.backend}, {len(result['samples'])} ranks, {args.ops} ops (warm-up {args.warmup}), "
        f"sizes up to {args.max_bytes >> 20} MiB, a group created and destroyed every {args.group_every} ops; "
        f"{result['seconds']:.0f} s. {platform.node()}, {datetime.date.today()}.",
        "",
        "| rank | RSS at start (MiB) | after warm-up (MiB) | half-way (MiB) | at the end (MiB) | "
        "growth over the second half (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for rank, samples in enumerate(result["samples"]):
        start, warm, half, end = samples[0][1], at(samples, args.warmup), at(samples, args.ops // 2), samples[-1][1]
        lines.append(f"| {rank} | {start:.0f} | {warm:.0f} | {half:.0f} | {end:.0f} | {end - half:+.1f} |")
    return "\n".join(lines)


def plot(result: dict, args, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed, so no plot was written to {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for rank, samples in enumerate(result["samples"]):
        ax.plot([i for i, _ in samples], [rss for _, rss in samples], label=f"rank {rank}")
    ax.axvline(args.warmup, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("operations")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"Memory soak on {args.backend}")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    try:
        result = soak(args)
    except WrongResult as wrong:
        print(f"WRONG: {wrong}", file=sys.stderr, flush=True)
        os._exit(1)  # the other ranks are inside an op that will not complete: no orderly shutdown
    if dist.get_rank() == 0:
        text = table(result, args)
        print(text, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result})
        )
        if args.plot:
            plot(result, args, args.plot)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
