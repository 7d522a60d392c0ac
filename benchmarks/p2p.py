#!/usr/bin/env python
"""Point-to-point latency and bandwidth between two ranks of one node: chainermn against torch's Gloo
and MPI (mpi4py) in the same run.

What is measured
----------------
A ping-pong: rank 0 sends S bytes (float32) to rank 1, which sends them back; the one-way time is half
a round trip, and the bandwidth S / one-way time (GB/s = 1e9 bytes per second). For each size every
contender runs --rounds rounds of `iters` round trips (about --seconds per round), each started by a
barrier; the contenders take turns round by round, so a change in the machine's load hits them alike.
The time reported is the median round's. Every received buffer is checked (the last element).

Contenders:
  chainermn   dist.send / dist.recv on the chainermn default group: within a node through the
              shared-memory rings (comm/shm_mailbox.h), each message with its header (checked_transfers.h)
  functions   torch_chainermn.functions.send / recv (model parallelism: ChainerMN's API, the message
              says its shapes and dtypes; messages/tensors.py), what MultiNodeChainList's stages use
  gloo        the same calls on dist.new_group(backend="gloo") (TCP over loopback)
  mpi4py      MPI.COMM_WORLD.Send / Recv on the tensors' numpy views: only under mpiexec with mpi4py

Run it (2 ranks)
------
    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/p2p.py [--bind]
    mpiexec --allow-run-as-root -n 2 .venv/bin/python benchmarks/p2p.py --plot benchmarks/results/p2p.png

Rank 0 prints a markdown table and writes it to --out (default benchmarks/results/p2p-<launcher>.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allreduce import human_bytes, import_mpi4py, launcher_name  # noqa: E402

MPI, MPI_SKIPPED = import_mpi4py()  # before torch_chainermn: see import_mpi4py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch_chainermn  # noqa: E402  registers the backend
from torch_chainermn import functions  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4 << 10, 64 << 10, 1 << 20, 16 << 20], help="bytes")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=0.15, help="about this long per round")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="PNG of one-way time per size (needs matplotlib)")
    p.add_argument(
        "--bind",
        action="store_true",
        help="bind each rank to core LOCAL_RANK first, as mpiexec does (torchrun does not)",
    )
    return p.parse_args()


def contenders(gloo):
    def torch_pair(group):
        def round_trip(x, rank):
            if rank == 0:
                dist.send(x, 1, group=group)
                dist.recv(x, 1, group=group)
            else:
                dist.recv(x, 0, group=group)
                dist.send(x, 0, group=group)

        return round_trip

    def functions_round_trip(x, rank):
        # The received tensor is a new one: it is copied into x for the check only after the timed
        # loop (see last_received), so the loop times send and recv alone.
        peer = 1 - rank
        if rank == 0:
            functions.send(x, communicator, peer)
            last_received[0] = functions.recv(communicator, peer)
        else:
            last_received[0] = functions.recv(communicator, peer)
            functions.send(last_received[0], communicator, peer)

    communicator = torch_chainermn.communicator.Communicator()
    found = {"chainermn": torch_pair(None), "functions": functions_round_trip, "gloo": torch_pair(gloo)}
    if MPI is not None:
        comm = MPI.COMM_WORLD

        def mpi_round_trip(x, rank):
            buf = x.numpy()
            if rank == 0:
                comm.Send(buf, dest=1)
                comm.Recv(buf, source=1)
            else:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)

        found["mpi4py"] = mpi_round_trip
    return found


last_received = [None]  # the last tensor the functions contender received


def timed(round_trip, x, rank, iters) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        round_trip(x, rank)
    elapsed = (time.perf_counter() - start) / iters / 2
    functions.drain()  # the functions' sends are not waited for: all of them have gone now
    if last_received[0] is not None:
        x.copy_(last_received[0])
        last_received[0] = None
    return elapsed


def main():
    args = parse_args()
    if args.bind:
        os.sched_setaffinity(0, {(torch_chainermn._launch.record().local_rank or 0) % os.cpu_count()})
    dist.init_process_group("chainermn")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("benchmarks/p2p.py runs on 2 ranks")
    torch.set_num_threads(1)
    gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in args.sizes:
        x = torch.zeros(nbytes // 4)
        found = contenders(gloo)
        iters = {}
        for name, round_trip in found.items():
            round_trip(x, rank)  # warm up, and estimate the iterations of a round (rank 0's, for all)
            estimate = torch.tensor([max(timed(round_trip, x, rank, 3), 1e-7)], dtype=torch.float64)
            dist.broadcast(estimate, 0)
            iters[name] = max(3, int(args.seconds / (2 * estimate.item())))
        times = {name: [] for name in found}
        for _ in range(args.rounds):
            for name, round_trip in found.items():
                x.fill_(-1.0)
                if rank == 0:
                    x[-1] = 7.0
                times[name].append(timed(round_trip, x, rank, iters[name]))
                if x.numel() and x[-1].item() != 7.0:
                    raise SystemExit(f"{name}: rank {rank} received {x[-1].item()}, expected 7.0")
        for name in found:
            one_way = statistics.median(times[name])
            rows.append((nbytes, name, one_way * 1e6, nbytes / one_way / 1e9, iters[name]))
    if rank == 0:
        report(args, rows)
    dist.destroy_process_group()


def report(args, rows):
    launcher = launcher_name()
    bound = "ranks bound to cores" if args.bind or launcher == "mpiexec" else "ranks not bound"
    lines = [
        f"Point to point, 2 ranks of one node, launched by {launcher} ({bound}); {platform.node()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {datetime.date.today()}; median of {args.rounds} rounds."
        + ("" if MPI is not None else f" MPI row skipped: {MPI_SKIPPED}."),
        "",
        "| size | contender | one-way (us) | GB/s | vs gloo |",
        "|---:|---|---:|---:|---:|",
    ]
    gloo = {nbytes: us for nbytes, name, us, _, _ in rows if name == "gloo"}
    for nbytes, name, us, gbps, _ in rows:
        lines.append(f"| {human_bytes(nbytes)} | {name} | {us:.1f} | {gbps:.2f} | {gloo[nbytes] / us:.2f}x |")
    text = "\n".join(lines)
    print(text, flush=True)
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"p2p-{launcher}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    if args.plot:
        plot(args.plot, rows)


def plot(path, rows):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        print(f"no plot: {error}")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(name for _, name, _, _, _ in rows):
        points = [(nbytes, us) for nbytes, n, us, _, _ in rows if n == name]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes")
    ax.set_ylabel("one-way time (us, lower is better)")
    ax.set_title("send/recv between 2 ranks of one node")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
