#!/usr/bin/env python
"""all_reduce bus bandwidth of the "chainermn" backend, measured against torch's Gloo, MPI and memcpy.

What is measured
----------------
For every message size S (float32, from --min-bytes to --max-bytes in steps of x4) and every contender,
each rank runs a few warm-up all-reduces, then --repeats timed loops of `iters` all-reduces, each loop
started right after a barrier. `iters` is chosen per point so that one point takes about
--seconds-per-point, which means fewer iterations for large messages. The time t of one all-reduce is
the median over the loops of (elapsed / iters), taken from the slowest rank.

Bandwidths are defined as in nccl-tests (doc/PERFORMANCE.md), with n ranks:

    algbw = S / t
    busbw = algbw * 2(n-1)/n

Any all-reduce algorithm has to move at least 2(n-1)/n * S bytes in and out of each rank (a ring
does n-1 reduce-scatter steps and n-1 all-gather steps of S/n bytes each). busbw is therefore the
rate each rank's link actually ran at: it does not depend on n, and it can be set against the
hardware's bandwidth. GB/s here means 1e9 bytes per second.

Contenders, measured in the same processes on the same buffer:
  <strategy>/<transport> dist.all_reduce on dist.new_group(backend="chainermn",
                         pg_options=torch_chainermn.Options(communicator=<strategy>)), for each of
                         ChainerMN's CPU strategies (naive, flat, hierarchical, two_dimensional,
                         single_node; --strategies picks). The transport is MPI under mpiexec and Gloo
                         under torchrun; within a node every strategy but naive reduces through shared
                         memory. single_node is skipped (and why printed) on several nodes.
  gloo                   dist.all_reduce on dist.new_group(backend="gloo").
  mpi4py                 MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, tensor.numpy(), op=MPI.SUM); only
                         under mpiexec and when mpi4py imports, otherwise the row is skipped (and why
                         is printed).
  memcpy                 dst.copy_(src) of S bytes on rank 0 alone, one thread, reported as S / t.
With --device cuda the tensors are on each rank's GPU (ranks beyond the GPUs share them, see
use_local_gpu), pure_nccl joins the strategies, torch's nccl replaces gloo, there is no mpi4py row,
and memcpy is a device-to-device copy.
                         Not an all-reduce: a reference for what the memory can do, an upper bound
                         for an all-reduce between processes of one host.
Each time includes the Python call of its API, as a training script would pay it.

Two more cases, off by default:
  --isolated   Besides the back-to-back loops above, one all-reduce at a time, the way DDP issues a
               bucket's all-reduce between pieces of backward computation: a barrier on a gloo group,
               then one all-reduce alone, timed on every rank; the time of an op is the largest over
               the ranks (an all-reduce MAX on the gloo group), and the figure is the median over
               --isolated-repeats such ops. The contenders take turns op by op (one op of each per
               repeat, the first one rotating), so a drift of the machine reaches them all alike. A
               back-to-back loop keeps every helper thread hot; an isolated op also pays for waking
               them, which is what a busy machine makes expensive. (memcpy has no isolated row.)
  --busy N     N busy processes (a Python `while True` loop each) spin beside the ranks for the whole
               measurement. The rank with local rank 0 on each host starts them after joining the
               group, with an affinity of every core (not that rank's binding under mpiexec), and
               stops them when it leaves, on an error or Ctrl-C too; each spinner also watches its
               parent and ends by itself within milliseconds if its rank dies (even killed -9). The
               driver (--launch) passes --busy on to every launch, so direct runs and driven ones
               start them the same way, and they never run during a launch's start-up.
With neither option the measurement, output and files are exactly as described above.

Run it
------
    # one launch; chainermn uses MPI, mpi4py row present (as root: --allow-run-as-root)
    mpiexec --allow-run-as-root --oversubscribe -n 2 .venv/bin/python benchmarks/allreduce.py
    # one launch; chainermn uses Gloo, no MPI row
    .venv/bin/torchrun --nproc-per-node 2 benchmarks/allreduce.py
    # both launches for every configuration: 2 ranks, 4 ranks, 4 ranks as 2 simulated nodes of 2
    .venv/bin/python benchmarks/allreduce.py --launch both --configs 2 4 2x2 --plot benchmarks/results/allreduce.png
    # back-to-back and isolated ops, with one busy process beside the 2 ranks
    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/allreduce.py --isolated --busy 1

A configuration "N" is N ranks on one node; "KxM" is K nodes of M ranks, simulated on this host with
CHAINERMN_RANKS_PER_NODE=M (the strategies see K nodes; the bytes still move through this host).
Each launch prints its rows on rank 0; with --json PATH rank 0 also writes them to PATH. The driver
(--launch) writes benchmarks/results/allreduce-<config>-<launcher>.json for each launch and
allreduce.md with one table per launch (with --isolated a second table per launch, the isolated
ops; with --busy N the files are named allreduce-<config>-<launcher>-busyN.json and allreduce-busyN.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO / "benchmarks" / "results"
LAUNCHERS = ("mpiexec", "torchrun")
# ChainerMN's communicators that run on CPU tensors (pure_nccl is CUDA-only).
STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional", "single_node")
# One colour per contender in every panel of the plot (matplotlib's tab10).
COLORS = {
    "naive": "tab:blue",
    "flat": "tab:orange",
    "hierarchical": "tab:green",
    "two_dimensional": "tab:red",
    "single_node": "tab:purple",
    "pure_nccl": "tab:olive",
    "gloo": "tab:brown",
    "nccl": "tab:brown",
    "mpi4py": "tab:pink",
}

FLOAT32_BYTES = 4
GB = 1e9
WARMUP_BYTES = 128 * 2**20  # cap on the data pushed through warm-up, so large sizes warm up once or twice
MAX_ITERS = 100_000


# ----------------------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="all_reduce bus bandwidth: chainermn vs gloo vs MPI (mpi4py) vs memcpy",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--min-bytes", type=int, default=4 * 2**10, help="smallest message, in bytes")
    parser.add_argument("--max-bytes", type=int, default=256 * 2**20, help="largest message, in bytes")
    parser.add_argument(
        "--warmup", type=int, default=5, help="warm-up all-reduces per point (fewer for large messages)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per point; the median is reported")
    parser.add_argument(
        "--seconds-per-point", type=float, default=0.5, help="aim for this much timed work per (contender, size)"
    )
    parser.add_argument("--json", type=Path, help="rank 0 writes the rows here (a launch)")
    parser.add_argument(
        "--launch",
        choices=("none",) + LAUNCHERS + ("both",),
        default="none",
        help="none: this process is a rank; otherwise start the launch(es) as subprocesses",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        type=parse_config,
        metavar="N|KxM",
        help="--launch only: one launch per configuration and launcher; N ranks on one node, "
        "or K simulated nodes of M ranks (default: 2)",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES + ("pure_nccl",),
        help="chainermn communicators to measure (default: every CPU one; with --device cuda pure_nccl too)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the tensors live; cuda compares against torch's nccl instead of gloo",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where --launch writes its files")
    parser.add_argument(
        "--checks-off-too",
        action="store_true",
        help="also measure each strategy with its cross-rank checks off (Options(checks='off')), "
        "to show what the checks cost",
    )
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="also time one all-reduce at a time after a gloo barrier (DDP's pattern), the "
        "contenders taking turns op by op; a second table, dotted lines in the plot",
    )
    parser.add_argument(
        "--isolated-repeats",
        type=int,
        default=20,
        help="--isolated: ops per (contender, size); the median of their slowest-rank times",
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="N busy (spinning) processes beside the ranks during the measurement, started "
        "and stopped by local rank 0 of each host",
    )
    parser.add_argument("--plot", type=Path, help="write a log-log PNG of busbw vs message size here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a launch is killed (--launch only)")
    args = parser.parse_args(argv)
    if not 0 < args.min_bytes <= args.max_bytes:
        parser.error("need 0 < --min-bytes <= --max-bytes")
    if args.repeats < 1 or args.warmup < 1 or args.isolated_repeats < 1:
        parser.error("--repeats, --warmup and --isolated-repeats must be >= 1")
    if args.busy < 0:
        parser.error("--busy must be >= 0")
    if args.configs is None:
        args.configs = [parse_config("2")]  # argparse would not pass a list default through parse_config
    if args.strategies is None:
        args.strategies = list(STRATEGIES) + (["pure_nccl"] if args.device == "cuda" else [])
    return args


def parse_config(text: str) -> tuple[int, int]:
    """'N' -> (N ranks, N per node); 'KxM' -> (K*M ranks, M per node)."""
    try:
        if "x" in text:
            nodes, per_node = (int(part) for part in text.split("x"))
        else:
            nodes, per_node = 1, int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a configuration is N or KxM (e.g. 4 or 2x2), got {text!r}") from None
    if nodes < 1 or per_node < 1 or nodes * per_node < 2:
        raise argparse.ArgumentTypeError(f"a configuration needs at least 2 ranks, got {text!r}")
    return nodes * per_node, per_node


def config_name(ranks: int, per_node: int) -> str:
    return str(ranks) if ranks == per_node else f"{ranks // per_node}x{per_node}"


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """min_bytes, 4x that, 16x ... up to max_bytes, each a whole number of float32 elements."""
    sizes, size = [], max(FLOAT32_BYTES, min_bytes - min_bytes % FLOAT32_BYTES)
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def human_bytes(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


# ------------------------------------------------------------------------------- process environment


def launched_by_mpiexec() -> bool:
    # Checked through the environment, before anything initializes MPI: importing mpi4py outside
    # mpiexec would start an MPI singleton that nobody asked for. (After `import torch_chainermn`,
    # torch_chainermn._launch.record() says it; mpi4py must be imported before that.)
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def import_mpi4py():
    """(MPI module, "") under mpiexec when mpi4py imports, else (None, why the MPI row is skipped).

    Must run before `import torch_chainermn`: mpi4py then initializes MPI (at MPI_THREAD_MULTIPLE,
    its default, which torch_chainermn needs) and torch_chainermn finds it already initialized.
    """
    if not launched_by_mpiexec():
        return None, "not launched by mpiexec"
    try:
        from mpi4py import MPI
    except ImportError as error:
        return None, f"mpi4py does not import ({error}); pip install mpi4py"
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        # Not fatal for the MPI row itself, but torch_chainermn will then fall back to Gloo.
        print(f"warning: MPI provides thread level {MPI.Query_thread()}, not MPI_THREAD_MULTIPLE", file=sys.stderr)
    return MPI, ""


def launcher_name() -> str:
    if launched_by_mpiexec():
        return "mpiexec"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "env://"


# ------------------------------------------------------------------------------------ busy processes

# One busy process (--busy): `while True` spinning on any core. sys.argv[1] is the pid of the process
# that started it: once that process is gone (its parent changes) the spinner ends by itself, so not
# even a rank killed with SIGKILL leaves one behind. The check costs nothing next to the spinning
# (every ~100k loop iterations, a few milliseconds). "spinning" on stdout says it has started.
SPINNER_CODE = """\
# chainermn benchmark --busy: spins until its parent stops it or is gone
import os, sys
parent = int(sys.argv[1])
try:
    os.sched_setaffinity(0, range(os.cpu_count()))  # any core, not the binding of the rank that started it
except (AttributeError, OSError):
    pass
sys.stdout.write("spinning\\n")
sys.stdout.flush()
try:
    while True:
        for _ in range(100000):
            pass
        if os.getppid() != parent:
            break
except KeyboardInterrupt:  # Ctrl-C reaches the whole foreground process group: end quietly
    pass
"""


class BusyProcesses:
    """A context manager: `n` spinning processes while inside it, stopped on the way out (also on an
    error or KeyboardInterrupt). Entering returns once every spinner runs."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self) -> "BusyProcesses":
        try:
            for _ in range(self.n):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", SPINNER_CODE, str(os.getpid())],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                    )
                )
            for proc in self.procs:
                if proc.stdout.readline() != b"spinning\n":
                    raise RuntimeError(f"busy process {proc.pid} did not start (exit status {proc.poll()})")
                proc.stdout.close()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


def busy_processes(n: int, local_rank: int | None, rank: int) -> BusyProcesses:
    """--busy n for this rank: the spinners where this is local rank 0 of its host (rank 0 where the
    launcher does not say), none elsewhere, so a host gets n whatever its number of ranks."""
    first_here = local_rank == 0 if local_rank is not None else rank == 0
    return BusyProcesses(n if first_here else 0)


# -------------------------------------------------------------------------------------------- timing


def no_wait() -> None:
    pass


def time_loop(op, barrier, iters: int, finish=no_wait) -> float:
    """Seconds per op over one loop of `iters` ops, started together on every rank.

    `finish` waits for the device: CUDA operations return once queued (torch.cuda.synchronize)."""
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    finish()
    return (time.perf_counter() - start) / iters


def measure(op, barrier, slowest, nbytes: int, args, finish=no_wait) -> tuple[float, int]:
    """(seconds per op, iterations per timed loop) for one contender at one size.

    `slowest(x)` returns the largest x over the ranks taking part, so that every rank runs the
    same number of iterations and the reported time is the slowest rank's.
    """
    warmup = max(1, min(args.warmup, WARMUP_BYTES // nbytes))
    for _ in range(warmup):
        op()
    finish()
    per_loop = args.seconds_per_point / args.repeats
    estimate = estimate_seconds(op, barrier, slowest, per_loop, finish)
    iters = int(min(MAX_ITERS, max(1, round(per_loop / estimate))))
    times = [time_loop(op, barrier, iters, finish) for _ in range(args.repeats)]
    return slowest(statistics.median(times)), iters


def estimate_seconds(op, barrier, slowest, per_loop: float, finish=no_wait) -> float:
    """A rough time per op, from loops grown until one lasts a tenth of a timed loop.

    A single short loop is too noisy to size the timed loops from: a few microseconds of jitter on
    a 5-op loop would change the iteration count tenfold.
    """
    iters = 1
    while True:
        elapsed = slowest(time_loop(op, barrier, iters, finish) * iters)
        if elapsed >= per_loop / 10 or iters >= MAX_ITERS:
            return max(elapsed, 1e-9) / iters
        iters = min(MAX_ITERS, iters * 4)


ISOLATED_WARMUP_ROUNDS = 3  # untimed rounds of isolated ops (every contender once) before the timed ones


def time_isolated(op, barrier, slowest, finish=no_wait) -> float:
    """Seconds of one op started right after `barrier`, alone, from the slowest rank."""
    barrier()
    start = time.perf_counter()
    op()
    finish()
    return slowest(time.perf_counter() - start)


def measure_isolated(ops: list, barrier, slowest, repeats: int, finish=no_wait) -> list[float]:
    """The median seconds of one isolated op (time_isolated) for each of `ops`, which take turns op by
    op: every round runs each op once, starting one further along the list each time."""
    times: list[list[float]] = [[] for _ in ops]
    for round_ in range(ISOLATED_WARMUP_ROUNDS + repeats):
        for k in range(len(ops)):
            i = (round_ + k) % len(ops)
            seconds = time_isolated(ops[i], barrier, slowest, finish)
            if round_ >= ISOLATED_WARMUP_ROUNDS:
                times[i].append(seconds)
    return [statistics.median(t) for t in times]


# --------------------------------------------------------------------------------------- contenders


class Contender:
    """One way to all-reduce a float32 tensor in place, with a matching barrier."""

    def __init__(self, label: str, allreduce, barrier):
        self.label, self.allreduce, self.barrier = label, allreduce, barrier


def make_contenders(
    dist, torch_chainermn, MPI, transport: str, strategies, device: str, checks_off_too=False
) -> tuple[list[Contender], list[str]]:
    """The contenders, and why any strategy was left out."""
    contenders, skipped = [], []
    for name in strategies:
        if name == "single_node" and torch_chainermn.topology().inter_size > 1:
            skipped.append("single_node: refuses several nodes")
            continue
        if name == "pure_nccl" and device != "cuda":
            skipped.append("pure_nccl: CUDA tensors only")
            continue
        for checks in ("info", "off") if checks_off_too else ("info",):
            group = dist.new_group(
                backend="chainermn", pg_options=torch_chainermn.Options(communicator=name, checks=checks)
            )
            contenders.append(
                Contender(
                    f"{name}/{transport}" + (" checks=off" if checks == "off" else ""),
                    # Default arguments bind this iteration's group (a closure would see the last one).
                    lambda t, group=group: dist.all_reduce(t, group=group),
                    lambda group=group: dist.barrier(group=group),
                )
            )
    # torch's own backend for the device: gloo for CPU tensors, nccl for CUDA tensors.
    name = "nccl" if device == "cuda" else "gloo"
    theirs = dist.new_group(backend=name)
    contenders.append(Contender(name, lambda t: dist.all_reduce(t, group=theirs), lambda: dist.barrier(group=theirs)))
    if device == "cuda":
        return contenders, skipped  # MPI_Allreduce from mpi4py takes host buffers
    if MPI is not None:
        comm = MPI.COMM_WORLD
        contenders.append(
            Contender(
                "mpi4py",
                # The numpy array shares the tensor's memory: MPI reduces the very buffer the others use.
                lambda t: comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM),
                comm.Barrier,
            )
        )
    return contenders, skipped


def check_allreduce(contender: Contender, buf, rank: int, world: int) -> str:
    """'' when one all-reduce of (rank + 1) everywhere gives n(n+1)/2 everywhere, else what went wrong."""
    buf.fill_(rank + 1)
    contender.allreduce(buf)
    expected = world * (world + 1) / 2
    wrong = (buf != expected).nonzero()
    if len(wrong) == 0:
        return ""
    first = int(wrong[0])
    return (
        f"{len(wrong)} of {buf.numel()} elements wrong on rank {rank}, "
        f"e.g. [{first}] = {float(buf[first])}, expected {expected}"
    )


def row(launcher, contender, kind, ranks, nbytes, seconds, iters, repeats, error="", mode="back-to-back") -> dict:
    algbw = nbytes / seconds / GB
    # memcpy is not an all-reduce: its "busbw" is plainly bytes / time (one rank, no 2(n-1)/n).
    busbw = algbw * 2 * (ranks - 1) / ranks if kind == "allreduce" else algbw
    return {
        "launcher": launcher,
        "contender": contender,
        "kind": kind,
        "ranks": ranks,
        "bytes": nbytes,
        "time_us": seconds * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": busbw,
        "iters": iters,
        "repeats": repeats,
        "error": error,
        # "back-to-back": loops of `iters` ops; "isolated" (--isolated): single ops after a barrier.
        "mode": mode,
    }


def mode_of(r: dict) -> str:
    return r.get("mode", "back-to-back")  # files written before --isolated existed have no "mode"


# ------------------------------------------------------------------------------------------- a rank


def run_rank(args) -> None:
    MPI, mpi_skipped = import_mpi4py()  # before torch_chainermn, see import_mpi4py

    sys.path.insert(0, str(REPO))  # the package, also when it is not pip-installed
    import torch
    import torch.distributed as dist

    import torch_chainermn

    # One compute thread: the ranks share few cores, and memcpy should be one thread's copy.
    torch.set_num_threads(1)
    if not torch_chainermn._launch.record().rendezvous:
        sys.exit("start this script with mpiexec or torchrun, or use --launch both (see --help)")
    finish = no_wait
    if args.device == "cuda":
        use_local_gpu(torch, torch_chainermn._launch.record())
        finish = torch.cuda.synchronize

    dist.init_process_group("chainermn", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    transport = torch_chainermn.transport()
    launcher = launcher_name()
    contenders, skipped = make_contenders(
        dist, torch_chainermn, MPI, transport, args.strategies, args.device, args.checks_off_too
    )
    # A separate group for bookkeeping (agreeing on counts, checks), so it never queues behind or
    # between the measured operations of a contender's own group.
    control = dist.new_group(backend="gloo")

    def slowest(x: float) -> float:
        value = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control)
        return float(value)

    meta = describe_run(torch, torch_chainermn, MPI, mpi_skipped, launcher, world, transport)
    meta["skipped"] = skipped
    meta["device"] = args.device
    meta["busy"] = args.busy
    meta["isolated_repeats"] = args.isolated_repeats if args.isolated else None
    if rank == 0:
        print_header(meta)

    # The spinners (--busy) run from here until this rank leaves the loop below, however it leaves.
    with busy_processes(args.busy, torch_chainermn._launch.record().local_rank, rank):
        rows = measure_sizes(torch, dist, contenders, control, slowest, launcher, rank, world, args, finish)

    if rank == 0:
        meta["loadavg_end"] = os.getloadavg()[0]
        print_notes(meta)
        if args.json:
            write_json(args.json, {"meta": meta, "rows": rows})
            print(f"rows written to {args.json}")
        if args.plot:
            plot([{"meta": meta, "rows": rows}], args.plot)
    dist.barrier(group=control)  # rank 0 hosts the store: nobody leaves while others may still use it
    dist.destroy_process_group()


def measure_sizes(torch, dist, contenders, control, slowest, launcher, rank, world, args, finish) -> list[dict]:
    """Every size, every contender (and memcpy on rank 0): the rows, printed by rank 0 as they come."""
    rows = []
    for nbytes in message_sizes(args.min_bytes, args.max_bytes):
        # One buffer per size, used by every contender (mpi4py through .numpy()).
        buf = torch.empty(nbytes // FLOAT32_BYTES, dtype=torch.float32, device=args.device)
        for contender in contenders:
            error = check_allreduce(contender, buf, rank, world)
            if error:
                print(
                    f"rank {rank}: {contender.label} gave wrong values at {human_bytes(nbytes)}: {error}",
                    file=sys.stderr,
                    flush=True,
                )
            # Zeros sum to zeros: the timed loops never overflow nor reach slow denormals.
            buf.zero_()
            seconds, iters = measure(lambda: contender.allreduce(buf), contender.barrier, slowest, nbytes, args, finish)
            if not error and bool(buf.any()):
                error = f"non-zero values after all-reducing zeros on rank {rank}"
            # Every rank's verdict counts: rank 0 reports the row as wrong if any rank saw wrong values.
            if slowest(1.0 if error else 0.0) > 0 and not error:
                error = "wrong values on another rank"
            rows.append(row(launcher, contender.label, "allreduce", world, nbytes, seconds, iters, args.repeats, error))
            if rank == 0:
                print_row(rows[-1], flush=True)
        errors = [r["error"] for r in rows[-len(contenders) :]]
        if rank == 0:
            seconds, iters = measure_memcpy(torch, buf, nbytes, args, finish)
            rows.append(row(launcher, "memcpy", "memcpy", 1, nbytes, seconds, iters, args.repeats))
            print_row(rows[-1], flush=True)
        dist.barrier(group=control)  # the other ranks wait here (sleeping in Gloo) while rank 0 copies
        if args.isolated:
            buf.zero_()
            # The barrier is the control group's (gloo) for every contender, as DDP's ops follow
            # computation rather than a barrier of their own group.
            times = measure_isolated(
                [lambda c=c: c.allreduce(buf) for c in contenders],
                lambda: dist.barrier(group=control),
                slowest,
                args.isolated_repeats,
                finish,
            )
            # One buffer for all: a non-zero sum afterwards cannot be pinned on one of them.
            late = "non-zero values after the isolated all-reduces of zeros" if slowest(float(bool(buf.any()))) else ""
            for contender, seconds, error in zip(contenders, times, errors):
                rows.append(
                    row(
                        launcher,
                        contender.label,
                        "allreduce",
                        world,
                        nbytes,
                        seconds,
                        1,
                        args.isolated_repeats,
                        error or late,
                        mode="isolated",
                    )
                )
                if rank == 0:
                    print_row(rows[-1], flush=True)
        del buf
    return rows


def measure_memcpy(torch, src, nbytes: int, args, finish) -> tuple[float, int]:
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), no_wait, lambda x: x, nbytes, args, finish)


def use_local_gpu(torch, launch) -> None:
    """Each rank takes GPU local_rank mod the GPUs there are (see share_gpu)."""
    if not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA GPU")
    share_gpu(torch, launch.local_rank or 0, launch.local_world_size or 1)


def share_gpu(torch, local_rank: int, local_size: int) -> None:
    """Rank local_rank of local_size takes GPU local_rank mod the GPUs there are. When ranks must share
    a GPU, NCCL (ours and torch's alike) refuses them as duplicates on one host unless each has its
    own NCCL_HOSTID (see DESIGN.md); then loopback sockets carry the traffic. Must run before the first
    NCCL communicator is created."""
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local_rank % gpus)
    if local_size > gpus:
        os.environ.setdefault("NCCL_HOSTID", f"chainermn-benchmark-{local_rank}")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")


def describe_run(torch, torch_chainermn, MPI, mpi_skipped, launcher, world, transport) -> dict:
    topology = torch_chainermn.topology()
    meta = {
        "launcher": launcher,
        "ranks": world,
        "chainermn_transport": transport,
        "nodes": topology.inter_size,
        "ranks_per_node": topology.intra_size,
        "config": config_name(world, topology.intra_size),
        "torch": torch.__version__,
        "torch_chainermn": torch_chainermn.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mpi4py": None,
        "mpi_library": None,
        "mpi_skipped": mpi_skipped,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        # Anything else running on the host shows up in the numbers: keep a trace of it.
        "loadavg_start": os.getloadavg()[0],
    }
    if MPI is not None:
        import mpi4py

        meta["mpi4py"] = mpi4py.__version__
        meta["mpi_library"] = MPI.Get_library_version().split(",")[0].strip()  # "Open MPI v4.1.4"
    return meta


# ------------------------------------------------------------------------------------------- output

ROW_HEADER = "| size | contender | time (us) | algbw (GB/s) | busbw (GB/s) | iters x repeats |"
ROW_RULE = "|---:|---|---:|---:|---:|---:|"


def format_us(us: float) -> str:
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def print_header(meta: dict) -> None:
    print(
        f"# all_reduce, float32, {meta['ranks']} ranks ({meta['nodes']} node(s) of {meta['ranks_per_node']}), "
        f"launched by {meta['launcher']}; chainermn transport: {meta['chainermn_transport']}"
    )
    for reason in meta["skipped"]:
        print(f"# skipped {reason}")
    print(
        f"# torch {meta['torch']}, torch_chainermn {meta['torch_chainermn']}, "
        f"{meta['cpus']} CPUs, {meta['torch_threads']} torch thread(s)"
    )
    if meta["mpi4py"]:
        print(f"# mpi4py {meta['mpi4py']} on {meta['mpi_library']}")
    else:
        print(f"# MPI (mpi4py) row skipped: {meta['mpi_skipped']}")
    if meta.get("busy"):
        print(f"# {meta['busy']} busy process(es) spinning beside the ranks of each host (--busy)")
    if meta.get("isolated_repeats"):
        print(
            f"# rows marked 'isolated': one all-reduce after a gloo barrier, slowest rank, median of "
            f"{meta['isolated_repeats']} (--isolated)"
        )
    print(ROW_HEADER)
    print(ROW_RULE, flush=True)


def print_row(r: dict, flush=False) -> None:
    label = r["contender"] + (" (1 rank, upper-bound reference)" if r["kind"] == "memcpy" else "")
    label += ", isolated" if mode_of(r) == "isolated" else ""
    wrong = f" WRONG: {r['error']}" if r["error"] else ""
    print(
        f"| {human_bytes(r['bytes'])} | {label}{wrong} | {format_us(r['time_us'])} | {r['algbw_GBps']:.3f} "
        f"| {r['busbw_GBps']:.3f} | {r['iters']} x {r['repeats']} |",
        flush=flush,
    )


def print_notes(meta: dict) -> None:
    n = meta["ranks"]
    print(
        f"# busbw = algbw * 2(n-1)/n = algbw * {2 * (n - 1) / n:g} (nccl-tests); "
        "memcpy: bytes / time of dst.copy_(src) on rank 0"
    )
    print(
        f"# 1-minute load average: {meta['loadavg_start']:.2f} at the start, {meta['loadavg_end']:.2f} at the end "
        f"({meta['cpus']} CPUs; well above {meta['ranks']} means something else competed for the cores)"
    )


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


def launch_title(meta: dict) -> str:
    where = (
        f"{meta['ranks']} ranks on one node"
        if meta["nodes"] == 1
        else f"{meta['ranks']} ranks as {meta['nodes']} simulated nodes of {meta['ranks_per_node']}"
    )
    tensors = ", CUDA tensors" if meta.get("device") == "cuda" else ""
    busy = f", {meta['busy']} busy process(es)" if meta.get("busy") else ""
    return f"{where}, {meta['launcher']}{tensors}{busy}"


def columns_of(result: dict, mode: str = "back-to-back") -> dict[str, list[dict]]:
    """One launch's rows of one mode by contender, in measuring order (the strategies, gloo, mpi4py,
    memcpy)."""
    columns: dict[str, list[dict]] = {}
    for r in result["rows"]:
        if mode_of(r) == mode:
            name = "memcpy (1 rank)" if r["kind"] == "memcpy" else r["contender"]
            columns.setdefault(name, []).append(r)
    return columns


def modes_of(result: dict) -> list[str]:
    """'back-to-back', then 'isolated' if the launch measured it (--isolated)."""
    return ["back-to-back"] + (["isolated"] if any(mode_of(r) == "isolated" for r in result["rows"]) else [])


def launch_table(result: dict, mode: str = "back-to-back") -> list[str]:
    """A markdown table for one launch and mode: a row per size, a column per contender, cells
    'busbw (time)'."""
    meta, columns = result["meta"], columns_of(result, mode)
    sizes = sorted({r["bytes"] for rows in columns.values() for r in rows})
    mpi = (
        f"mpi4py {meta['mpi4py']} on {meta['mpi_library']}" if meta["mpi4py"] else f"no MPI row: {meta['mpi_skipped']}"
    )
    if mode == "isolated":
        title = (
            f"**{launch_title(meta)}, isolated**: one all-reduce after a gloo barrier, slowest rank, "
            f"median of {meta.get('isolated_repeats')} (the contenders in turns)"
        )
    else:
        title = (
            f"**{launch_title(meta)}** (transport {meta['chainermn_transport']}; torch {meta['torch']}; {mpi}; "
            f"load average {meta['loadavg_start']:.2f} -> {meta['loadavg_end']:.2f}"
            + "".join(f"; skipped {reason}" for reason in meta.get("skipped", []))
            + ")"
        )
        if len(modes_of(result)) > 1:
            title += ", back-to-back loops"
    lines = [
        title,
        "",
        "| size | " + " | ".join(columns) + " |",
        "|---:|" + "---:|" * len(columns),
    ]
    for nbytes in sizes:
        cells = []
        for rows in columns.values():
            r = next((r for r in rows if r["bytes"] == nbytes), None)
            if r is None:
                cells.append("-")
            else:
                cell = f"{r['busbw_GBps']:.2f} ({format_us(r['time_us'])} us)"
                cells.append(cell + (" WRONG" if r["error"] else ""))
        lines.append(f"| {human_bytes(nbytes)} | " + " | ".join(cells) + " |")
    return lines


def combined_tables(results: list[dict]) -> str:
    lines = ["all_reduce of float32: busbw in GB/s (time per all-reduce in us)", ""]
    for result in results:
        for mode in modes_of(result):
            lines += launch_table(result, mode) + [""]
    lines.append(
        "busbw = bytes / time * 2(n-1)/n as in nccl-tests. memcpy is one rank's `dst.copy_(src)` "
        "(bytes / time), an upper bound for comparison, not an all-reduce."
    )
    if any(len(modes_of(result)) > 1 for result in results):
        lines.append(
            "Back-to-back: loops of all-reduces, each loop after a barrier; isolated: each all-reduce "
            "alone after a gloo barrier, as DDP issues them."
        )
    return "\n".join(lines)


def import_pyplot(path: Path):
    """matplotlib.pyplot on the Agg backend (no display needed), or None, after saying that no plot
    was written to `path`, when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(
            f"matplotlib is not installed, so no plot was written to {path} "
            f"(pip install matplotlib into this Python: {sys.executable})"
        )
        return None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def plot(results: list[dict], path: Path) -> None:
    """One log-log panel of busbw against size per launch; isolated ops (--isolated) dotted."""
    plt = import_pyplot(path)
    if plt is None:
        return

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 4.5 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        sizes = set()
        for mode in modes_of(result):
            for name, rows in columns_of(result, mode).items():
                rows = sorted(rows, key=lambda r: r["bytes"])
                xs, ys = [r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows]
                sizes.update(xs)
                base = name.split("/")[0]
                style = (
                    dict(linestyle="--", color="gray")
                    if rows[0]["kind"] == "memcpy"
                    else dict(linestyle=":" if mode == "isolated" else "-", color=COLORS.get(base))
                )
                label = f"{name}, isolated" if mode == "isolated" else name
                ax.loglog(xs, ys, marker="o" if mode != "isolated" else "s", label=label, **style)
        ticks = sorted(sizes)
        ax.set_xticks(ticks, [human_bytes(s) for s in ticks])
        ax.minorticks_off()
        ax.set_xlabel("message size (bytes, float32)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"all_reduce bus bandwidth: {launch_title(result['meta'])}")
        ax.grid(True, which="major", alpha=0.4)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never hides a line
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


# ------------------------------------------------------------------------------------------- driver


def launch_command(launcher: str, ranks: int, args, json_path: Path) -> list[str]:
    """The command line of one launch, with this run's measurement options passed on."""
    script = [
        str(Path(__file__).resolve()),
        "--min-bytes",
        str(args.min_bytes),
        "--max-bytes",
        str(args.max_bytes),
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--seconds-per-point",
        str(args.seconds_per_point),
        "--json",
        str(json_path),
        "--strategies",
        *args.strategies,
        "--device",
        args.device,
    ]
    if args.checks_off_too:
        script.append("--checks-off-too")
    if args.isolated:
        script += ["--isolated", "--isolated-repeats", str(args.isolated_repeats)]
    if args.busy:
        script += ["--busy", str(args.busy)]  # the ranks start them (local rank 0), see BusyProcesses
    if launcher == "mpiexec":
        mpiexec = shutil.which("mpiexec")
        if mpiexec is None:
            raise FileNotFoundError("mpiexec is not on PATH")
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        # --oversubscribe: allow more ranks than cores; -x: pass these variables to remote ranks too.
        return [
            mpiexec,
            *root,
            "--oversubscribe",
            "-n",
            str(ranks),
            "-x",
            "OMP_NUM_THREADS",
            "-x",
            "CHAINERMN_RANKS_PER_NODE",
            sys.executable,
            *script,
        ]
    # --standalone: a private rendezvous on a free port, so nothing else on this host interferes.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *script]


def run_launch(command: list[str], per_node: int, timeout: float, omp_threads: int = 1) -> int:
    """Run one launch in its own process group, so a hang can be killed as a whole; its exit status."""
    env = dict(os.environ, OMP_NUM_THREADS=str(omp_threads), CHAINERMN_RANKS_PER_NODE=str(per_node))
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"launch still running after {timeout:.0f} s: killing it", file=sys.stderr)
        stop_launch(proc)
        return -1
    except BaseException:
        # Ctrl-C: in its own session the launch did not get the signal; stop it before leaving.
        stop_launch(proc)
        raise


def stop_launch(proc: subprocess.Popen) -> None:
    """SIGTERM to the launch's process group (torchrun passes it on to its ranks, which have sessions
    of their own; mpiexec to its ranks), SIGKILL after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone
    proc.wait()


def drive(args) -> int:
    start = time.perf_counter()
    launchers = LAUNCHERS if args.launch == "both" else (args.launch,)
    results, failures = [], []
    busy = f"-busy{args.busy}" if args.busy else ""  # files of a busy run never replace an idle run's
    for ranks, per_node in args.configs:
        for launcher in launchers:
            name = f"{config_name(ranks, per_node)}-{launcher}{busy}"
            json_path = args.out_dir / f"allreduce-{name}.json"
            json_path.unlink(missing_ok=True)  # a stale file must not pass for this run's results
            try:
                command = launch_command(launcher, ranks, args, json_path)
            except FileNotFoundError as error:
                failures.append(f"{name}: {error}")
                continue
            print(f"\n$ CHAINERMN_RANKS_PER_NODE={per_node} {shlex.join(command)}", flush=True)
            launch_start = time.perf_counter()
            status = run_launch(command, per_node, args.timeout)
            print(f"({name}: exit status {status}, {time.perf_counter() - launch_start:.1f} s)", flush=True)
            if status != 0 or not json_path.exists():
                failures.append(f"{name}: exit status {status}" + ("" if json_path.exists() else ", no results"))
                continue
            results.append(json.loads(json_path.read_text()))

    if results:
        table = combined_tables(results)
        md_path = args.out_dir / f"allreduce{busy}.md"
        md_path.write_text(table + "\n")
        print("\n" + table + f"\n\n(table written to {md_path})")
        if args.plot:
            plot(results, args.plot)
    for failure in failures:
        print(f"launch failed: {failure}", file=sys.stderr)
    print(f"total wall time: {time.perf_counter() - start:.1f} s")
    return 1 if failures or not results else 0


def main() -> None:
    args = parse_args()
    if args.launch != "none":
        sys.exit(drive(args))
    run_rank(args)


if __name__ == "__main__":
    main()
