#!/usr/bin/env python
"""DDP training step time on CPU: the "chainermn" backend against torch's Gloo, in the same processes.

What is measured
----------------
A ResNet-18 (torchvision's layout, gpu.py's resnet18: a 7x7/2 stem and a 3x3/2 max-pool, four stages of
two BasicBlocks 64-128-256-512 wide, global average pool, a linear layer; 11.2M parameters, 62
tensors, 45 MB of float32 gradients per step) is trained with SGD (momentum 0.9) under
DistributedDataParallel on synthetic data: batches of --batch 3x--image-size x--image-size images
and labels, drawn once per rank from a seeded generator and cycled. At the default 32x32 the
convolutions are small and DDP's all-reduce of the gradients is a large part of the step, which is
what this benchmark compares; --image-size 64 makes the compute 4x heavier, --width 32 the
gradients 4x lighter.

Three replicas of the same model (same initial weights) are wrapped by three DDPs in the same ranks:
  chainermn   DDP(model) on the default process group, dist.init_process_group("chainermn")
  gloo        DDP(copy of the model, process_group=dist.new_group(backend="gloo"))
  none        DDP(copy of the model) with a comm hook that returns each bucket as it is: the same
              step with no communication at all, the floor no backend can go below. gloo / none is
              the most any backend could gain on gloo on this machine, in this run.
A step is forward, cross-entropy loss, backward (during which DDP all-reduces the gradient buckets
over its group) and optimizer.step(). All first take --warmup steps, in turns; then --repeats
rounds, each one block of --steps consecutive steps of each (which one goes first rotates round by
round, so a drift of the machine reaches them alike). Every block starts after a barrier on a
separate (gloo) group, used only for bookkeeping; its time per step is the slowest rank's. The table
gives, per contender, the median over the rounds and their range (min-max), the ratio gloo /
chainermn (above 1: chainermn's step is faster), and the share of chainermn's step above the floor
(chainermn / none - 1: what its communication still costs).

The chainermn and gloo replicas see the same batches in the same order, so they must end with the
same parameters and BatchNorm statistics; the last column says so, or WRONG with the largest
difference (over all ranks) when they differ by more than float32 rounding (rtol 1e-4, atol 1e-6).
(The floor's replica never averages its gradients: it drifts apart, and is not compared.)

Each (threads, busy) pair is its own launch, since torch's intra-op threads are a per-process
setting:
  --threads T  torch.set_num_threads(T) in every rank (and OMP_NUM_THREADS=T in the driver's launches)
  --busy N     N busy processes spin beside the ranks (allreduce.py's BusyProcesses: started by local
               rank 0 after joining the group, on any core, stopped when the rank leaves, also on an
               error or Ctrl-C; each ends by itself if its rank dies)

Run it
------
    # the driver: one torchrun launch of 2 ranks per (threads, busy), a table over all of them
    .venv/bin/python benchmarks/ddp_step.py --launch --threads 1 2 --busy 0 1
    # one launch by hand (one --threads and one --busy value), chainermn over Gloo
    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/ddp_step.py --threads 1 --busy 1
    # or chainermn over MPI (as root: --allow-run-as-root)
    mpiexec --allow-run-as-root -n 2 .venv/bin/python benchmarks/ddp_step.py

The driver writes into benchmarks/results/ (--out-dir, git-ignored) ddp_step-t<T>-busy<N>.json for each
launch, and ddp_step.md (the table), ddp_step.json (every launch) and ddp_step.png (bars of the
median step time with their range; needs matplotlib). A launch by hand prints its row, and writes its
JSON with --json PATH.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # allreduce.py: busy processes, launches, JSON
from allreduce import busy_processes, import_pyplot, launcher_name, run_launch, write_json  # noqa: E402

DEFAULT_OUT_DIR = BENCHMARKS / "results"
BACKENDS = ("chainermn", "gloo")
FLOOR = "none"  # the same step without communication (a comm hook that returns each bucket as it is)
CONTENDERS = BACKENDS + (FLOOR,)
COLORS = {"chainermn": "tab:green", "gloo": "tab:brown", FLOOR: "tab:gray"}  # as in allreduce.py's plot
RTOL, ATOL = 1e-4, 1e-6


# ----------------------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="DDP step time of a ResNet-18 on CPU: chainermn vs gloo, interleaved in the same ranks",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--launch",
        action="store_true",
        help="be the driver: one torchrun launch per (threads, busy) pair, then one table",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1],
        help="torch intra-op threads per rank; several only with --launch",
    )
    parser.add_argument(
        "--busy",
        type=int,
        nargs="+",
        default=[0],
        metavar="N",
        help="busy (spinning) processes beside the ranks; several only with --launch",
    )
    parser.add_argument("--ranks", type=int, default=2, help="--launch: ranks per launch")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block (per backend and round)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; the median and range are reported")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each backend first")
    parser.add_argument("--batch", type=int, default=16, help="images per rank and step")
    parser.add_argument("--image-size", type=int, default=32, help="images are 3 x size x size")
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage (64: ResNet-18)")
    parser.add_argument("--classes", type=int, default=10, help="labels, the size of the last layer")
    parser.add_argument("--batches", type=int, default=4, help="distinct synthetic batches per rank, cycled")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights (all ranks) and data (per rank)")
    parser.add_argument("--json", type=Path, help="rank 0 writes the launch's result here")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where --launch writes its files")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a launch is killed (--launch only)")
    args = parser.parse_args(argv)
    if not args.launch and (len(args.threads) > 1 or len(args.busy) > 1):
        parser.error("several --threads or --busy values need --launch (each pair is its own launch)")
    if min(args.threads) < 1 or min(args.busy) < 0 or args.ranks < 2:
        parser.error("need --threads >= 1, --busy >= 0, --ranks >= 2")
    if min(args.steps, args.repeats, args.batch, args.batches, args.image_size, args.width) < 1 or args.warmup < 0:
        parser.error("--steps, --repeats, --batch, --batches, --image-size and --width must be >= 1")
    return args


# -------------------------------------------------------------------------------------------- model


def build_model(args):
    """ResNet-18's layout with `args.width` channels in its first stage (gpu.py's ResNet, torchvision's
    layout, so no torchvision needed); the same weights in every process for the same --seed."""
    import torch

    from gpu import resnet18  # imported here, as torch: the driver (--launch) needs neither

    torch.manual_seed(args.seed)
    return resnet18(args.width, args.classes)


# ------------------------------------------------------------------------------------------- a rank


def run_rank(args) -> None:
    sys.path.insert(0, str(REPO))  # the package, also when it is not pip-installed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_chainermn

    threads, busy = args.threads[0], args.busy[0]
    torch.set_num_threads(threads)
    launch = torch_chainermn._launch.record()
    if not launch.rendezvous:
        sys.exit("start this script with torchrun or mpiexec, or use --launch (see --help)")
    dist.init_process_group("chainermn", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    # None: the default group. The floor's group is never used: its hook replaces the all-reduce.
    groups = {"chainermn": None, "gloo": dist.new_group(backend="gloo"), FLOOR: dist.new_group(backend="gloo")}
    control = dist.new_group(backend="gloo")  # barriers and maxima only, never behind a measured op

    def slowest(x: float) -> float:
        value = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control)
        return float(value)

    model = build_model(args)
    models = {"chainermn": model, "gloo": copy.deepcopy(model), FLOOR: copy.deepcopy(model)}
    ddps = {name: DDP(models[name], process_group=groups[name]) for name in CONTENDERS}
    ddps[FLOOR].register_comm_hook(None, no_communication)
    optimizers = {name: torch.optim.SGD(ddps[name].parameters(), lr=0.01, momentum=0.9) for name in CONTENDERS}
    data = torch.Generator().manual_seed(args.seed + 1 + rank)
    batches = [
        (
            torch.randn(args.batch, 3, args.image_size, args.image_size, generator=data),
            torch.randint(args.classes, (args.batch,), generator=data),
        )
        for _ in range(args.batches)
    ]
    taken = dict.fromkeys(CONTENDERS, 0)  # steps each has taken: all walk the same batches

    def step(name: str) -> None:
        x, y = batches[taken[name] % len(batches)]
        taken[name] += 1
        optimizers[name].zero_grad(set_to_none=True)
        F.cross_entropy(ddps[name](x), y).backward()
        optimizers[name].step()

    def block(name: str) -> float:
        """Seconds per step over --steps steps started together, from the slowest rank."""
        dist.barrier(group=control)
        start = time.perf_counter()
        for _ in range(args.steps):
            step(name)
        return slowest((time.perf_counter() - start) / args.steps)

    meta = {
        "launcher": launcher_name(),
        "ranks": world,
        "threads": threads,
        "busy": busy,
        "chainermn_transport": torch_chainermn.transport(),
        "batch": args.batch,
        "image_size": args.image_size,
        "width": args.width,
        "classes": args.classes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_tensors": len(list(model.parameters())),
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "torch_chainermn": torch_chainermn.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "loadavg_start": os.getloadavg()[0],
    }
    if rank == 0:
        print(f"# {describe(meta)}", flush=True)

    times = {name: [] for name in CONTENDERS}
    # The spinners (--busy) run from here until this rank leaves the block, however it leaves.
    with busy_processes(busy, launch.local_rank, rank):
        for _ in range(args.warmup):
            for name in CONTENDERS:
                step(name)
        for round_ in range(args.repeats):
            first = round_ % len(CONTENDERS)  # each contender goes first in turn
            for name in CONTENDERS[first:] + CONTENDERS[:first]:
                times[name].append(block(name))
    meta["loadavg_end"] = os.getloadavg()[0]

    difference = max_difference(torch, models["chainermn"], models["gloo"])
    difference["abs"] = slowest(difference["abs"])
    difference["equal"] = slowest(0.0 if difference["equal"] else 1.0) == 0.0
    result = {"meta": meta, "difference": difference, "times": {name: summary(times[name]) for name in CONTENDERS}}
    if rank == 0:
        for line in table([result]):
            print(line)
        if args.json:
            write_json(args.json, result)
            print(f"result written to {args.json}")
    dist.barrier(group=control)  # rank 0 hosts the store: nobody leaves while others may still use it
    dist.destroy_process_group()


def no_communication(state, bucket):
    """A DDP comm hook that communicates nothing: the bucket's local gradients, at once."""
    import torch

    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def max_difference(torch, a, b) -> dict:
    """The largest |a - b| over parameters and buffers (BatchNorm statistics), and whether every
    tensor is within float32 rounding (rtol RTOL, atol ATOL)."""
    largest, equal = 0.0, True
    for (name, x), (_, y) in zip(
        list(a.named_parameters()) + list(a.named_buffers()), list(b.named_parameters()) + list(b.named_buffers())
    ):
        x, y = x.detach().double(), y.detach().double()
        largest = max(largest, float((x - y).abs().max()))
        equal = equal and bool(torch.allclose(x, y, rtol=RTOL, atol=ATOL))
    return {"abs": largest, "equal": equal}


def summary(seconds: list[float]) -> dict:
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds), "all": seconds}


# ------------------------------------------------------------------------------------------- output


def describe(meta: dict) -> str:
    return (
        f"DDP step of ResNet-18 (width {meta['width']}, {meta['parameters'] / 1e6:.1f}M parameters in "
        f"{meta['parameter_tensors']} tensors), batch {meta['batch']} of 3x{meta['image_size']}x{meta['image_size']} "
        f"per rank, {meta['ranks']} ranks by {meta['launcher']} (chainermn over {meta['chainermn_transport']}), "
        f"{meta['steps']} steps x {meta['repeats']} rounds after {meta['warmup']} warm-up; torch {meta['torch']}, "
        f"{meta['cpus']} CPUs"
    )


def cell(t: dict) -> str:
    return f"{t['median']:.4f} ({t['min']:.4f}-{t['max']:.4f})"


def table(results: list[dict]) -> list[str]:
    """Markdown: a row per launch, step times as 'median (min-max)' in seconds."""
    lines = [
        "| threads | busy | chainermn s/step | gloo s/step | no communication s/step | gloo / chainermn "
        "| gloo / no communication | chainermn above the floor | load average | check |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        meta, ours, theirs, floor = r["meta"], r["times"]["chainermn"], r["times"]["gloo"], r["times"][FLOOR]
        check = (
            f"equal (max diff {r['difference']['abs']:.3g})"
            if r["difference"]["equal"]
            else f"WRONG: parameters differ by up to {r['difference']['abs']:.3g}"
        )
        lines.append(
            f"| {meta['threads']} | {meta['busy']} | {cell(ours)} | {cell(theirs)} | {cell(floor)} "
            f"| {theirs['median'] / ours['median']:.2f} | {theirs['median'] / floor['median']:.2f} "
            f"| {ours['median'] / floor['median'] - 1:+.0%} "
            f"| {meta['loadavg_start']:.1f} -> {meta['loadavg_end']:.1f} | {check} |"
        )
    return lines


def report(results: list[dict]) -> str:
    lines = [
        f"{describe(results[0]['meta'])}.",
        "",
        "Seconds per step (forward, backward with DDP's all-reduces, SGD step): median over the rounds "
        "(min-max); gloo / chainermn above 1: chainermn faster. no communication: the same step with a comm "
        "hook that returns each bucket as it is, the floor; gloo / no communication is the most any backend "
        "could gain on gloo in this run. busy: spinning processes beside the ranks. "
        "check: the chainermn and gloo DDPs end with the same parameters.",
        "",
    ]
    return "\n".join(lines + table(results))


def plot(results: list[dict], path: Path) -> None:
    """Bars of the median step time per (threads, busy) and backend, with the range as error bars."""
    plt = import_pyplot(path)
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(results) + 2), 4.5))
    xs = range(len(results))
    bar = 0.27
    for k, name in enumerate(CONTENDERS):
        t = [r["times"][name] for r in results]
        medians = [x["median"] * 1e3 for x in t]
        below = [(x["median"] - x["min"]) * 1e3 for x in t]
        above = [(x["max"] - x["median"]) * 1e3 for x in t]
        ax.bar(
            [x + (k - 1) * bar for x in xs],
            medians,
            bar,
            yerr=[below, above],
            capsize=3,
            color=COLORS[name],
            label="no communication" if name == FLOOR else name,
        )
    for x, r in zip(xs, results):
        ratio = r["times"]["gloo"]["median"] / r["times"]["chainermn"]["median"]
        top = max(r["times"][name]["max"] for name in CONTENDERS) * 1e3
        mark = "" if r["difference"]["equal"] else " WRONG"
        ax.annotate(
            f"x{ratio:.2f}{mark}", (x, top), textcoords="offset points", xytext=(0, 4), ha="center", fontsize="small"
        )
    ax.set_xticks(list(xs), [f"{r['meta']['threads']} thread(s)\nbusy {r['meta']['busy']}" for r in results])
    ax.set_ylabel("ms per step (median, range)")
    meta = results[0]["meta"]
    ax.set_title(
        f"DDP step, ResNet-18 w{meta['width']}, batch {meta['batch']} of {meta['image_size']}px, "
        f"{meta['ranks']} ranks ({meta['launcher']})\nlabels: gloo / chainermn",
        fontsize="medium",
    )
    ax.margins(y=0.15)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


# ------------------------------------------------------------------------------------------- driver


def launch_command(args, ranks: int, threads: int, busy: int, json_path: Path) -> list[str]:
    """A torchrun launch of this script for one (threads, busy), this run's options passed on."""
    script = [
        str(Path(__file__).resolve()),
        "--threads",
        str(threads),
        "--busy",
        str(busy),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
        "--image-size",
        str(args.image_size),
        "--width",
        str(args.width),
        "--classes",
        str(args.classes),
        "--batches",
        str(args.batches),
        "--seed",
        str(args.seed),
        "--json",
        str(json_path),
    ]
    # --standalone: a private rendezvous on a free port, so nothing else on this host interferes.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *script]


def drive(args) -> int:
    start = time.perf_counter()
    results, failures = [], []
    for threads in args.threads:
        for busy in args.busy:
            name = f"t{threads}-busy{busy}"
            json_path = args.out_dir / f"ddp_step-{name}.json"
            json_path.unlink(missing_ok=True)  # a stale file must not pass for this run's results
            command = launch_command(args, args.ranks, threads, busy, json_path)
            print(f"\n$ OMP_NUM_THREADS={threads} {shlex.join(command)}", flush=True)
            launch_start = time.perf_counter()
            status = run_launch(command, args.ranks, args.timeout, omp_threads=threads)
            print(f"({name}: exit status {status}, {time.perf_counter() - launch_start:.1f} s)", flush=True)
            if status != 0 or not json_path.exists():
                failures.append(f"{name}: exit status {status}" + ("" if json_path.exists() else ", no results"))
                continue
            results.append(json.loads(json_path.read_text()))

    if results:
        text = report(results)
        md_path = args.out_dir / "ddp_step.md"
        md_path.write_text(text + "\n")
        write_json(args.out_dir / "ddp_step.json", {"results": results})
        print("\n" + text + f"\n\n(table written to {md_path}, every launch to {args.out_dir / 'ddp_step.json'})")
        plot(results, args.out_dir / "ddp_step.png")
    for failure in failures:
        print(f"launch failed: {failure}", file=sys.stderr)
    wrong = [r for r in results if not r["difference"]["equal"]]
    print(f"total wall time: {time.perf_counter() - start:.1f} s")
    return 1 if failures or wrong or not results else 0


def main() -> None:
    args = parse_args()
    if args.launch:
        sys.exit(drive(args))
    run_rank(args)


if __name__ == "__main__":
    main()
