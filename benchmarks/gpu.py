#!/usr/bin/env python
"""chainermn against torch's own backend on one machine's device (issue 13, "GPU speed"), in one run.

Written for a CUDA GPU; `--device cpu` runs the very same code on CPU tensors (torch's gloo in place of
nccl), which is how it is checked on machines without a GPU.

Sections (`--sections pack,ddp,allreduce`)
--------
1. pack: `torch_chainermn.mean_coalesced(grads, dtype=wire)` on a one-rank chainermn group, for the
   wire dtypes float16, bfloat16 and float32 and two models' gradient shapes: ResNet-50's 161
   parameter tensors (built here on the meta device, see `ResNet`) and a transformer's few large
   ones (`transformer_gradient_shapes`). With one rank the allreduce moves nothing, so the time is
   the backend's packing pass (cast, scale) plus its unpacking pass. Bytes are counted as

       pack reads 4N (float32 gradients) and writes wN (wire dtype of w bytes),
       unpack reads wN and writes 4N:     2 (4 + w) N bytes per call,

   and set against the device's copy bandwidth measured in the same process (`dst.copy_(src)` of a
   large float32 buffer, read + write). Beside it, torch's way of doing the same with one allreduce:
   `torch.cat` of the flattened gradients, `.to(wire)`, `div_`, one `all_reduce` on a one-rank group
   of torch's backend (nccl on CUDA, gloo on CPU), then the views of the result copied back
   (`torch._foreach_copy_`, casting). Its GB/s counts the same 2 (4 + w) N bytes, so the two columns
   compare times; it really moves more (cat writes a float32 copy first), and its temporaries are
   new on every call: on CUDA the caching allocator hands the same blocks back, on CPU a buffer this
   large comes fresh from the kernel each time (glibc maps it anew), page faults included.
2. ddp: training-step time of DistributedDataParallel (forward, backward, SGD step) with chainermn's
   hooks (`torch_chainermn.hooks`: allreduce, fp16/bf16 compression, double buffering) on a chainermn
   group against torch's default hooks (allreduce, fp16, bf16) and plain DDP on torch's backend.
   One rank by default (what a hook adds to a step when there is nothing to wait for); `--ranks 2`
   spawns two processes (on one GPU both share it, NCCL between them over loopback sockets).
3. allreduce: bus bandwidth of `all_reduce` on 2 ranks, 4 KiB up to `--max-bytes`, chainermn's
   pure_nccl, hierarchical and two_dimensional against torch's nccl (CPU: hierarchical and
   two_dimensional against gloo). Measured by `benchmarks/allreduce.py` (launched with torchrun), not
   duplicated here: this script reads its JSON and reports each strategy's busbw as a ratio to
   torch's, and the 4 KiB time (small-message latency).

Timing: every contender is warmed up, then run in `--repeats` timed loops; the contenders of a section
take turns loop by loop, so that a change in the machine's load hits them alike. A loop is sized to
last about `--loop-seconds`; the reported time is the median over the loops of (loop time /
iterations). On CUDA a loop is timed by CUDA events on the current stream (after a
torch.cuda.synchronize, so nothing earlier is counted), on CPU by time.perf_counter.

Run it (plain python, not torchrun: the script starts the ranks it needs)
------
    .venv/bin/python benchmarks/gpu.py                         # CUDA when there is a GPU
    .venv/bin/python benchmarks/gpu.py --device cpu            # the same on CPU tensors
    .venv/bin/python benchmarks/gpu.py --device cpu --quick    # tiny sizes: a smoke test (tests/test_benchmark_gpu.py)

It prints a markdown table per section and writes `gpu.md`, `gpu.json` (every number) and `gpu.png`
(busbw curves, packing GB/s; needs matplotlib) into `--out` (default benchmarks/results), beside
`allreduce.md` and `allreduce-2-torchrun.json` from the allreduce launch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(REPO))  # the package, also when it is not pip-installed
sys.path.insert(0, str(BENCHMARKS))  # allreduce.py, whose measurement section 3 runs
import allreduce as allreduce_benchmark  # noqa: E402
import torch_chainermn  # noqa: E402  registers the "chainermn" backend
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch_chainermn import hooks as chainermn_hooks  # noqa: E402

SECTIONS = ("pack", "ddp", "allreduce")
WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
GB = 1e9
MiB = 2**20
DEFAULT_OUT = BENCHMARKS / "results"


# ----------------------------------------------------------------------------------------- arguments


@dataclasses.dataclass
class Plan:
    """The sizes a run uses: set by the device, shrunk by --quick, overridden by explicit options."""

    device: torch.device
    repeats: int
    loop_seconds: float  # aim for timed loops this long
    copy_bytes: int  # the float32 buffer of the copy-bandwidth reference
    resnet_width: int  # 64: ResNet-50 itself; smaller keeps its 161 tensors, shrinks them
    transformer_layers: int
    transformer_width: int
    ddp_model: str  # "resnet50" or "small"
    batch: int
    image_size: int
    ddp_ranks: int
    allreduce_max_bytes: int
    allreduce_seconds_per_point: float


def parse_args(argv=None) -> tuple[argparse.Namespace, Plan]:
    parser = argparse.ArgumentParser(
        description="chainermn vs torch's backend on one device: packing, DDP step time, all_reduce busbw",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, among: " + ", ".join(SECTIONS))
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per contender; the median is reported")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes and short loops: a smoke test, not a measurement"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for gpu.md, gpu.json, gpu.png")
    parser.add_argument("--loop-seconds", type=float, help="length of one timed loop (default: 0.25, --quick 0.01)")
    parser.add_argument("--transformer-layers", type=int, help="layers of the transformer's gradients (default 12)")
    parser.add_argument(
        "--ddp-model", choices=("resnet50", "small"), help="DDP's model (default: resnet50 on CUDA, small on CPU)"
    )
    parser.add_argument("--batch", type=int, help="DDP's batch per rank (default: 64 for resnet50, 32 for small)")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="DDP's ranks (2: spawned processes)")
    parser.add_argument("--max-bytes", type=int, help="largest all_reduce (default: 256 MiB on CUDA, 16 MiB on CPU)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown or not args.sections:
        parser.error(f"--sections: choose among {', '.join(SECTIONS)}, got {args.sections}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda: torch sees no CUDA GPU")
    if args.device == "cuda" and not torch_chainermn._C.cuda_built:
        parser.error(
            "--device cuda: torch_chainermn was built without its CUDA path (torch_chainermn._C.cuda_built "
            "is False); rebuild it against this CUDA torch with nvcc on PATH"
        )
    return args, make_plan(args)


def make_plan(args) -> Plan:
    on_cuda, quick = args.device == "cuda", args.quick
    ddp_model = args.ddp_model or ("resnet50" if on_cuda and not quick else "small")
    if quick:
        batch, image_size = 4, 16
    elif ddp_model == "resnet50":
        batch, image_size = 64, 224
    else:
        batch, image_size = 32, 32
    return Plan(
        device=torch.device(args.device),
        repeats=min(args.repeats, 3) if quick else args.repeats,
        loop_seconds=args.loop_seconds or (0.01 if quick else 0.25),
        # Well past the last-level cache, so that it measures memory: 1 GiB on a GPU (50 MiB of L2),
        # 256 MiB on a CPU.
        copy_bytes=4 * MiB if quick else (1024 if on_cuda else 256) * MiB,
        resnet_width=4 if quick else 64,
        transformer_layers=args.transformer_layers or (2 if quick else 12),
        transformer_width=64 if quick else 1024,
        ddp_model=ddp_model,
        batch=args.batch or batch,
        image_size=image_size,
        ddp_ranks=args.ranks,
        allreduce_max_bytes=args.max_bytes or (16 * 2**10 if quick else (256 if on_cuda else 16) * MiB),
        allreduce_seconds_per_point=0.02 if quick else 0.5,
    )


# -------------------------------------------------------------------------------------------- timing


def nothing() -> None:
    pass


@dataclasses.dataclass
class Contender:
    """One way of doing the measured thing: `op` does it once; `finish` runs once at the end of every
    timed loop (e.g. to wait for communication still running in the background)."""

    label: str
    op: Callable[[], None]
    finish: Callable[[], None] = nothing


@dataclasses.dataclass
class Timing:
    """Seconds per op: the median over the timed loops, and the fastest and slowest loop."""

    median: float
    low: float
    high: float
    iters: int
    repeats: int

    @property
    def spread(self) -> float:
        return (self.high - self.low) / self.median


class Ranks:
    """How the ranks of one measurement agree: the same iteration counts, loops started together,
    and the slowest rank's time. One rank (control=None) needs none of it."""

    def __init__(self, control=None):
        self.control = control  # a gloo group apart from the measured ones, so it never queues among them

    def barrier(self) -> None:
        if self.control is not None:
            dist.barrier(group=self.control)

    def slowest(self, seconds: float) -> float:
        if self.control is None:
            return seconds
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.control)
        return float(value)


class Clock:
    """Times a loop of ops on one device: CUDA events on the current stream, else time.perf_counter.

    The events are made once: nothing is allocated per timed loop."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def settle(self) -> None:
        """Wait until the device has finished everything queued so far."""
        if self.cuda:
            torch.cuda.synchronize()

    def loop_seconds(self, contender: Contender, iters: int) -> float:
        """Seconds for `iters` ops and one finish."""
        op = contender.op
        if self.cuda:
            torch.cuda.synchronize()  # earlier work must not be counted
            self.start.record()
            for _ in range(iters):
                op()
            contender.finish()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3  # elapsed_time is in milliseconds
        start = time.perf_counter()
        for _ in range(iters):
            op()
        contender.finish()
        return time.perf_counter() - start


MAX_ITERS = 10_000


def iterations_for(clock: Clock, contender: Contender, target_seconds: float, ranks: Ranks) -> int:
    """Ops per timed loop so that one loop lasts about target_seconds, the same on every rank.

    Loops grow until one lasts a fifth of the target: a single op is too noisy to size loops from."""
    iters = 1
    while True:
        ranks.barrier()
        elapsed = ranks.slowest(clock.loop_seconds(contender, iters))
        if elapsed >= target_seconds / 5 or iters >= MAX_ITERS:
            return int(min(MAX_ITERS, max(1, round(target_seconds * iters / max(elapsed, 1e-9)))))
        iters *= 4


def time_in_turns(
    contenders: list[Contender],
    clock: Clock,
    plan: Plan,
    warmup: int,
    ranks: Ranks = Ranks(),
    failures: dict[str, str] | None = None,
) -> dict[str, Timing]:
    """Warm every contender up, size its loops, then time them loop by loop in turns.

    With `failures` given, a contender that raises during its warm-up is left out and its error
    recorded there, so that one broken path (CUDA paths that never ran on a GPU) costs one row, not
    the section. With several ranks that is only safe when it fails on every rank alike."""
    running = []
    for contender in contenders:
        try:
            for _ in range(warmup):
                contender.op()
            contender.finish()
            clock.settle()
        except Exception as error:  # noqa: BLE001  recorded and reported, see above
            if failures is None:
                raise
            failures[contender.label] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            print(f"{contender.label} failed in warm-up: {failures[contender.label]}", file=sys.stderr, flush=True)
            continue
        running.append(contender)
    iters = {c.label: iterations_for(clock, c, plan.loop_seconds, ranks) for c in running}
    samples: dict[str, list[float]] = {c.label: [] for c in running}
    for _ in range(plan.repeats):
        for contender in running:
            ranks.barrier()
            seconds = ranks.slowest(clock.loop_seconds(contender, iters[contender.label]))
            samples[contender.label].append(seconds / iters[contender.label])
    return {label: Timing(statistics.median(s), min(s), max(s), iters[label], len(s)) for label, s in samples.items()}


# ------------------------------------------------------------------------------------ models, shapes


class BasicBlock(nn.Module):
    """ResNet-18/34's block: two 3x3 convolutions."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = shortcut(inplanes, planes, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 down, 3x3 (stride here, as torchvision's v1.5), 1x1 up by 4."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.downsample = shortcut(inplanes, planes * 4, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.downsample(x))


def shortcut(inplanes: int, outplanes: int, stride: int) -> nn.Module:
    if stride == 1 and inplanes == outplanes:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(inplanes, outplanes, 1, stride, bias=False), nn.BatchNorm2d(outplanes))


class ResNet(nn.Module):
    """torchvision's ResNet layout, so that this script needs no torchvision: ResNet(Bottleneck,
    [3, 4, 6, 3]) has ResNet-50's 161 parameter tensors and 25,557,032 parameters. `width` scales
    every stage (64 is the real one)."""

    def __init__(self, block, layers: list[int], width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, inplanes = [], width
        for i, blocks in enumerate(layers):
            planes = width * 2**i
            stage = []
            for b in range(blocks):
                stage.append(block(inplanes, planes, 2 if (i > 0 and b == 0) else 1))
                inplanes = planes * block.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18(width: int = 64, num_classes: int = 1000) -> nn.Module:
    return ResNet(BasicBlock, [2, 2, 2, 2], width, num_classes)


def resnet50(width: int = 64, num_classes: int = 1000) -> nn.Module:
    return ResNet(Bottleneck, [3, 4, 6, 3], width, num_classes)


def resnet50_gradient_shapes(width: int) -> list[torch.Size]:
    """The parameter shapes of ResNet-50, from a model built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return [p.shape for p in resnet50(width).parameters()]


def transformer_gradient_shapes(layers: int, d: int) -> list[torch.Size]:
    """A GPT-style block per layer: fused qkv, output projection, a 4x MLP, two layer norms (weights
    and biases). Few tensors, most of them of millions of elements: the opposite of ResNet-50."""
    per_layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return [torch.Size(shape) for _ in range(layers) for shape in per_layer]


def ddp_model(plan: Plan) -> tuple[nn.Module, str, int]:
    """(model, its description, number of classes) for the DDP section."""
    if plan.ddp_model == "resnet50":
        try:
            import torchvision

            return torchvision.models.resnet50(), "ResNet-50 (torchvision)", 1000
        except ImportError:
            return resnet50(), "ResNet-50 (defined in gpu.py, torchvision's layout)", 1000
    width = 4 if plan.image_size <= 16 else 16
    # ResNet-10: one BasicBlock per stage; small enough for a step in tens of ms on two CPU cores.
    return ResNet(BasicBlock, [1, 1, 1, 1], width, 10), f"ResNet-10 (BasicBlock x [1,1,1,1], width {width})", 10


# ---------------------------------------------------------------------------------- process groups


@dataclasses.dataclass
class Groups:
    """The measured groups: the default one (chainermn) and one of torch's backend for the device."""

    chainermn: dist.ProcessGroup
    torch: dist.ProcessGroup
    torch_name: str  # "nccl" or "gloo"
    ranks: Ranks = dataclasses.field(default_factory=Ranks)


def torch_backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def open_groups(device: torch.device, store, rank: int, world: int) -> Groups:
    """The default group on chainermn, a group of torch's backend, and (several ranks) a control group."""
    dist.init_process_group(
        "chainermn", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    name = torch_backend_for(device)
    theirs = dist.new_group(backend=name)
    control = dist.new_group(backend="gloo") if world > 1 else None
    return Groups(dist.group.WORLD, theirs, name, Ranks(control))


def use_gpu_of_rank(rank: int, world: int) -> None:
    """Rank r takes GPU r mod the GPUs there are, as allreduce.py's ranks do (share_gpu)."""
    from allreduce import share_gpu  # benchmarks/ is this script's directory, first on sys.path

    share_gpu(torch, rank, world)


# ------------------------------------------------------------------------------- section 1: packing


def measure_copy_bandwidth(clock: Clock, plan: Plan) -> dict:
    """The device's copy bandwidth: `dst.copy_(src)` of a large float32 buffer, bytes read + written."""
    src = torch.randn(plan.copy_bytes // 4, device=plan.device)
    dst = torch.empty_like(src)
    copy = Contender("copy", lambda: dst.copy_(src))
    timing = time_in_turns([copy], clock, plan, warmup=3)[copy.label]
    return {"bytes": plan.copy_bytes, "ms": timing.median * 1e3, "GBps": 2 * plan.copy_bytes / timing.median / GB}


def chainermn_mean(grads: list[torch.Tensor], wire: torch.dtype, group) -> Contender:
    """The backend's packed mean: pack (cast, scale) into its reused buffer, allreduce, unpack (cast back)."""
    return Contender(f"chainermn {wire}", lambda: torch_chainermn.mean_coalesced(grads, group=group, dtype=wire))


def torch_flat_mean(grads: list[torch.Tensor], wire: torch.dtype, group) -> Contender:
    """torch's way to average many tensors in one allreduce, as DDP's fp16 hook does for its bucket:
    flatten (torch.cat), cast, divide before the sum (as torch's hooks do), all_reduce, copy back cast.
    The temporaries (the flat copy, the cast copy) are allocated by every call: that is this way's cost."""
    world = group.size()

    def op():
        flat = torch._utils._flatten_dense_tensors(grads)  # torch.cat of the flattened tensors
        packed = flat.to(wire)  # no copy when wire is float32
        packed.div_(world)
        dist.all_reduce(packed, group=group)
        torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(packed, grads))

    return Contender(f"torch {wire}", op)


def packing_models(plan: Plan) -> list[tuple[str, list[torch.Size]]]:
    resnet = "ResNet-50" if plan.resnet_width == 64 else f"ResNet-50 at width {plan.resnet_width}"
    transformer = f"Transformer {plan.transformer_layers} x d={plan.transformer_width}"
    return [
        (resnet, resnet50_gradient_shapes(plan.resnet_width)),
        (transformer, transformer_gradient_shapes(plan.transformer_layers, plan.transformer_width)),
    ]


def run_packing_section(groups: Groups, plan: Plan) -> dict:
    clock = Clock(plan.device)
    copy_bw = measure_copy_bandwidth(clock, plan)
    print(f"copy bandwidth: {copy_bw['GBps']:.1f} GB/s", flush=True)
    rows, failures = [], []
    for model, shapes in packing_models(plan):
        # Gradients of the usual dtype; random values stay finite through every cast and mean of one rank.
        grads = [torch.randn(shape, device=plan.device) for shape in shapes]
        elements = sum(g.numel() for g in grads)
        contenders = []
        for wire in WIRE_DTYPES.values():
            contenders += [chainermn_mean(grads, wire, groups.chainermn), torch_flat_mean(grads, wire, groups.torch)]
        failed: dict[str, str] = {}
        timings = time_in_turns(contenders, clock, plan, warmup=2, failures=failed)
        failures += [f"{model}, {label}: {error}" for label, error in failed.items()]
        for wire_name, wire in WIRE_DTYPES.items():
            nbytes = 2 * (4 + wire.itemsize) * elements  # pack: 4N in, wN out; unpack: wN in, 4N out
            row = {"model": model, "tensors": len(grads), "elements": elements, "wire": wire_name, "bytes": nbytes}
            for impl in ("chainermn", "torch"):
                timing = timings.get(f"{impl} {wire}")  # None: it failed (see failures)
                gbps = nbytes / timing.median / GB if timing else None
                row[impl] = timing and {
                    "ms": timing.median * 1e3,
                    "GBps": gbps,
                    "of_copy": gbps / copy_bw["GBps"],
                    "spread": timing.spread,
                    "iters": timing.iters,
                }
            rows.append(row)
        del grads, contenders
    return {"copy": copy_bw, "torch_backend": groups.torch_name, "rows": rows, "failures": failures}


# ------------------------------------------------------------------------------------ section 2: DDP


@dataclasses.dataclass
class HookSpec:
    backend: str  # "chainermn" or torch's backend name
    hook_name: str
    hook: Callable | None  # None: DDP's own allreduce
    state: object = None  # a process group, or a DoubleBufferingState
    double_buffering: bool = False


def ddp_hook_specs(groups: Groups) -> list[HookSpec]:
    ours, theirs = groups.chainermn, groups.torch
    return [
        HookSpec(groups.torch_name, "none (DDP's allreduce)", None),
        HookSpec(groups.torch_name, "allreduce_hook", default_hooks.allreduce_hook, theirs),
        HookSpec(groups.torch_name, "fp16_compress_hook", default_hooks.fp16_compress_hook, theirs),
        HookSpec(groups.torch_name, "bf16_compress_hook", default_hooks.bf16_compress_hook, theirs),
        HookSpec("chainermn", "none (DDP's allreduce)", None),
        HookSpec("chainermn", "allreduce_hook", chainermn_hooks.allreduce_hook, ours),
        HookSpec("chainermn", "fp16_compress_hook", chainermn_hooks.fp16_compress_hook, ours),
        HookSpec("chainermn", "bf16_compress_hook", chainermn_hooks.bf16_compress_hook, ours),
        HookSpec(
            "chainermn",
            "double_buffering_hook",
            chainermn_hooks.double_buffering_hook,
            chainermn_hooks.DoubleBufferingState(ours),
            True,
        ),
        HookSpec(
            "chainermn",
            "double_buffering_hook, float16",
            chainermn_hooks.double_buffering_hook,
            chainermn_hooks.DoubleBufferingState(ours, compression=torch.float16),
            True,
        ),
    ]


def ddp_training_step(spec: HookSpec, base: nn.Module, groups: Groups, plan: Plan, classes: int) -> Contender:
    """A DDP copy of `base` on the spec's group with its hook; op = one SGD training step on a fixed batch."""
    group = groups.chainermn if spec.backend == "chainermn" else groups.torch
    model = copy.deepcopy(base).to(plan.device)
    device_ids = [plan.device.index] if plan.device.type == "cuda" else None  # the index is set on CUDA
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=group)
    if spec.hook is not None:
        ddp.register_comm_hook(spec.state, spec.hook)  # raises when DDP refuses the hook here
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    # One batch made once: data loading is not what is measured.
    x = torch.randn(plan.batch, 3, plan.image_size, plan.image_size, device=plan.device)
    y = torch.randint(0, classes, (plan.batch,), device=plan.device)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    # Double buffering leaves the last step's mean in flight: each timed loop waits for it at its end.
    finish = spec.state.flush if spec.double_buffering else nothing
    return Contender(f"{spec.backend} | {spec.hook_name}", step, finish)


def run_ddp_section(groups: Groups, plan: Plan) -> dict:
    if plan.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # pick the convolution algorithms once, in warm-up
    torch.manual_seed(0)
    base, description, classes = ddp_model(plan)
    contenders, skipped = [], []
    for spec in ddp_hook_specs(groups):
        try:
            contenders.append(ddp_training_step(spec, base, groups, plan, classes))
        except (TypeError, RuntimeError, ValueError) as error:
            # e.g. DDP accepts torch's bf16_compress_hook only with CUDA and NCCL >= 2.10
            skipped.append(f"{spec.backend} {spec.hook_name}: {str(error).splitlines()[0]}")
    # 5 warm-up steps: DDP rebuilds its buckets after the first, cudnn.benchmark tries algorithms,
    # double buffering fills its pipeline.
    failed: dict[str, str] = {}
    timings = time_in_turns(contenders, Clock(plan.device), plan, warmup=5, ranks=groups.ranks, failures=failed)
    skipped += [f"{label.replace(' | ', ' ')}: failed: {error}" for label, error in failed.items()]
    contenders = [c for c in contenders if c.label in timings]
    reference = timings.get(f"{groups.torch_name} | none (DDP's allreduce)")
    rows = []
    for contender in contenders:
        backend, hook = contender.label.split(" | ")
        timing = timings[contender.label]
        rows.append(
            {
                "backend": backend,
                "hook": hook,
                "ms": timing.median * 1e3,
                "spread": timing.spread,
                "samples_per_s": plan.batch * dist.get_world_size() / timing.median,
                "vs_torch": timing.median / reference.median if reference else None,
                "iters": timing.iters,
            }
        )
    parameters = sum(p.numel() for p in base.parameters())
    return {
        "model": description,
        "parameters": parameters,
        "batch": plan.batch,
        "image_size": plan.image_size,
        "ranks": dist.get_world_size(),
        "torch_backend": groups.torch_name,
        "rows": rows,
        "skipped": skipped,
    }


def ddp_rank_main(rank: int, world: int, store_path: str, plan: Plan, result_path: str) -> None:
    """Body of one spawned rank of `--ranks 2`: the DDP section; rank 0 writes the result."""
    if plan.device.type == "cuda":
        use_gpu_of_rank(rank, world)
        plan = dataclasses.replace(plan, device=torch.device("cuda", torch.cuda.current_device()))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
    groups = open_groups(plan.device, dist.FileStore(store_path, world), rank, world)
    result = run_ddp_section(groups, plan)
    if rank == 0:
        Path(result_path).write_text(json.dumps(result))
    groups.ranks.barrier()  # nobody leaves while another rank may still use the groups
    dist.destroy_process_group()


def run_ddp_on_spawned_ranks(plan: Plan) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="chainermn-gpu-bench-") as tmp:
        result_path = Path(tmp) / "ddp.json"
        # A FileStore in a fresh directory: no port to choose, nothing shared with another run.
        mp.spawn(
            ddp_rank_main,
            args=(plan.ddp_ranks, str(Path(tmp) / "store"), plan, str(result_path)),
            nprocs=plan.ddp_ranks,
            join=True,
        )
        return json.loads(result_path.read_text())


# ---------------------------------------------------------------------------- section 3: allreduce


def allreduce_strategies(device: str) -> list[str]:
    return (["pure_nccl"] if device == "cuda" else []) + ["hierarchical", "two_dimensional"]


def run_allreduce_section(args, plan: Plan) -> dict:
    """2 ranks under torchrun, measured by benchmarks/allreduce.py; its JSON becomes this section."""
    argv = [
        "--launch",
        "torchrun",
        "--configs",
        "2",
        "--device",
        args.device,
        "--strategies",
        *allreduce_strategies(args.device),
        "--min-bytes",
        str(4 * 2**10),
        "--max-bytes",
        str(plan.allreduce_max_bytes),
        "--repeats",
        str(plan.repeats),
        "--seconds-per-point",
        str(plan.allreduce_seconds_per_point),
        "--out-dir",
        str(args.out),
    ]
    measured = allreduce_benchmark.parse_args(argv)
    status = allreduce_benchmark.drive(measured)
    json_path = args.out / "allreduce-2-torchrun.json"
    if status != 0 or not json_path.exists():
        raise RuntimeError(f"benchmarks/allreduce.py {' '.join(argv)} failed (exit status {status})")
    result = json.loads(json_path.read_text())
    return summarize_allreduce(result, torch_backend_for(plan.device))


def summarize_allreduce(result: dict, torch_name: str) -> dict:
    """busbw by size and contender, each chainermn strategy's ratio to torch's, and the 4 KiB times."""
    by_size: dict[int, dict[str, dict]] = {}
    for r in result["rows"]:
        if allreduce_benchmark.mode_of(r) != "back-to-back":
            continue  # isolated ops (allreduce.py --isolated), not asked for here
        # allreduce.py labels chainermn's rows "<strategy>/<host transport>"; the strategy is what differs.
        name = "memcpy" if r["kind"] == "memcpy" else r["contender"].split("/")[0]
        by_size.setdefault(r["bytes"], {})[name] = {"busbw": r["busbw_GBps"], "us": r["time_us"], "error": r["error"]}
    contenders = [c for c in next(iter(by_size.values()))]
    for cells in by_size.values():
        reference = cells.get(torch_name)
        for name, cell in cells.items():
            cell["ratio"] = (
                cell["busbw"] / reference["busbw"] if reference and name not in (torch_name, "memcpy") else None
            )
    return {
        "meta": result["meta"],
        "torch_backend": torch_name,
        "contenders": contenders,
        "sizes": {str(k): v for k, v in sorted(by_size.items())},
    }


# ------------------------------------------------------------------------------------------- output


def machine_description(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        machine = f"{name} ({props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})"
        version = torch.cuda.nccl.version()  # a tuple (2, 27, 5) in torch 2.x
        torch_nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    else:
        machine = f"CPU {cpu_model()} ({os.cpu_count()} cores)"
        torch_nccl = "none (CPU)"
    ours = torch_chainermn._C.nccl_version() or "not built (CPU build)"
    return {
        "machine": machine,
        "torch": torch.__version__,
        "torch_chainermn": torch_chainermn.__version__,
        "torch_nccl": torch_nccl,
        "chainermn_nccl": str(ours),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg()[0],
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def human_bytes(nbytes: int) -> str:
    return allreduce_benchmark.human_bytes(nbytes)


def num(x: float) -> str:
    """Three significant digits, in plain notation: 1234, 123.4 -> 123, 1.234 -> 1.23, 0.001234 -> 0.00123.

    Fixed decimals would print a slow contender's 0.004 GB/s as 0.0."""
    if x >= 100:
        return f"{x:.0f}"
    digits = 2 - math.floor(math.log10(abs(x))) if x > 0 else 2
    return f"{x:.{max(0, digits)}f}"


def millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def markdown_report(meta: dict, results: dict, plan: Plan) -> str:
    lines = [
        f"# chainermn vs torch on {meta['machine']}",
        "",
        f"{meta['date']}; torch {meta['torch']}, torch_chainermn {meta['torch_chainermn']}; "
        f"NCCL: torch {meta['torch_nccl']}, chainermn {meta['chainermn_nccl']}; device {plan.device.type}, "
        f"{meta['torch_threads']} torch thread(s); median of {plan.repeats} timed loops"
        + ("; --quick (tiny sizes: a smoke test, not a measurement)" if results.get("quick") else "")
        + f"; 1-minute load average {meta['loadavg_start']:.2f} -> {meta.get('loadavg_end', 0):.2f}",
        "",
    ]
    if "pack" in results:
        lines += packing_table(results["pack"])
    if "ddp" in results:
        lines += ddp_table(results["ddp"])
    if "allreduce" in results:
        lines += allreduce_tables(results["allreduce"])
    for section, error in results.get("errors", {}).items():
        lines += [f"## {section}: FAILED", "", f"    {error}", ""]
    return "\n".join(lines)


def packing_table(pack: dict) -> list[str]:
    copy_bw, torch_name = pack["copy"], pack["torch_backend"]
    lines = [
        "## 1. Packing: mean_coalesced on one rank (pack + unpack)",
        "",
        f"Copy bandwidth: {copy_bw['GBps']:.1f} GB/s (`dst.copy_(src)`, {human_bytes(copy_bw['bytes'])} float32, "
        "read + write). GB/s = 2 (4 + w) N bytes / time for N float32 elements and a wire dtype of w bytes; "
        '"of copy" = that / copy bandwidth. torch: cat, .to(wire), div_, all_reduce on a one-rank '
        f"{torch_name} group, _foreach_copy_ back (same bytes counted).",
        "",
        "| model | tensors | elements | wire | chainermn ms | chainermn GB/s | chainermn of copy | "
        f"torch ({torch_name}) ms | torch GB/s | torch of copy | chainermn speedup |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in pack["rows"]:
        cells = []
        for impl in ("chainermn", "torch"):
            m = r[impl]
            cells += [num(m["ms"]), num(m["GBps"]), num(m["of_copy"])] if m else ["failed"] * 3
        speedup = f"{num(r['torch']['ms'] / r['chainermn']['ms'])}x" if r["chainermn"] and r["torch"] else "-"
        lines.append(
            f"| {r['model']} | {r['tensors']} | {millions(r['elements'])} | {r['wire']} | "
            + " | ".join(cells)
            + f" | {speedup} |"
        )
    lines.append("")
    lines += [f"Failed: {failure}" for failure in pack["failures"]]
    return lines + ([""] if pack["failures"] else [])


def ddp_table(ddp: dict) -> list[str]:
    lines = [
        f"## 2. DDP step time: {ddp['model']}, {millions(ddp['parameters'])} parameters, batch {ddp['batch']} "
        f"of {ddp['image_size']}x{ddp['image_size']} per rank, {ddp['ranks']} rank(s)",
        "",
        "Forward, backward, SGD step; ms per step is the median over timed loops, spread = (slowest - fastest "
        f'loop) / median; "vs {ddp["torch_backend"]}" = step time / that of plain DDP on {ddp["torch_backend"]}.',
        "",
        f"| backend | hook | ms/step | spread | samples/s | vs {ddp['torch_backend']} DDP |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in ddp["rows"]:
        vs = num(r["vs_torch"]) if r["vs_torch"] is not None else "-"
        lines.append(
            f"| {r['backend']} | {r['hook']} | {num(r['ms'])} | {100 * r['spread']:.0f}% "
            f"| {num(r['samples_per_s'])} | {vs} |"
        )
    lines.append("")
    lines += [f"Not measured: {reason}" for reason in ddp["skipped"]]
    return lines + ([""] if ddp["skipped"] else [])


def allreduce_tables(summary: dict) -> list[str]:
    meta, torch_name, contenders = summary["meta"], summary["torch_backend"], summary["contenders"]
    lines = [
        f"## 3. all_reduce bus bandwidth, {meta['ranks']} ranks ({allreduce_benchmark.launch_title(meta)}), float32",
        "",
        f"busbw in GB/s (nccl-tests: bytes / time x 2(n-1)/n); chainermn cells: busbw (ratio to {torch_name}). "
        "memcpy: one rank's `dst.copy_(src)`, bytes / time, a reference. Measured by benchmarks/allreduce.py.",
        "",
        "| size | " + " | ".join(contenders) + " |",
        "|---:|" + "---:|" * len(contenders),
    ]
    for size, cells in summary["sizes"].items():
        out = []
        for name in contenders:
            cell = cells.get(name)
            if cell is None:
                out.append("-")
                continue
            text = num(cell["busbw"]) + (f" ({num(cell['ratio'])}x)" if cell["ratio"] is not None else "")
            out.append(text + (" WRONG" if cell["error"] else ""))
        lines.append(f"| {human_bytes(int(size))} | " + " | ".join(out) + " |")
    smallest = summary["sizes"][min(summary["sizes"], key=int)]
    reference = smallest.get(torch_name)
    lines += [
        "",
        f"Small messages: time per all_reduce of {human_bytes(int(min(summary['sizes'], key=int)))}",
        "",
        f"| contender | latency (us) | vs {torch_name} |",
        "|---|---:|---:|",
    ]
    for name in contenders:
        if name == "memcpy" or name not in smallest:
            continue
        us = smallest[name]["us"]
        lines.append(
            f"| {name} | {num(us)} | {num(us / reference['us'])}x |" if reference else f"| {name} | {num(us)} | - |"
        )
    return lines + [""]


def gbps(measured: dict | None) -> float:
    return measured["GBps"] if measured else 0.0  # a failed contender: no bar


def plot(results: dict, path: Path) -> None:
    """busbw against size (section 3) and packing GB/s bars (section 1), as far as they were run."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib into {sys.executable})")
        return
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels = [name for name in ("allreduce", "pack") if name in results]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    for ax, name in zip(axes[0], panels):
        if name == "allreduce":
            summary = results["allreduce"]
            sizes = [int(s) for s in summary["sizes"]]
            for contender in summary["contenders"]:
                points = [
                    (s, summary["sizes"][str(s)][contender]["busbw"])
                    for s in sizes
                    if contender in summary["sizes"][str(s)]
                ]
                style = dict(linestyle="--", color="gray") if contender == "memcpy" else {}
                ax.loglog([p[0] for p in points], [p[1] for p in points], marker="o", label=contender, **style)
            ax.set_xticks(sizes, [human_bytes(s) for s in sizes], rotation=45)
            ax.minorticks_off()
            ax.set_xlabel("message size (float32)")
            ax.set_ylabel("busbw (GB/s)")
            ax.set_title(f"all_reduce, {summary['meta']['ranks']} ranks")
        else:
            pack = results["pack"]
            labels = [f"{r['model'].split(' ')[0]}\n{r['wire']}" for r in pack["rows"]]
            xs = range(len(labels))
            ax.bar(
                [x - 0.2 for x in xs],
                [gbps(r["chainermn"]) for r in pack["rows"]],
                0.4,
                label="chainermn mean_coalesced",
            )
            ax.bar(
                [x + 0.2 for x in xs],
                [gbps(r["torch"]) for r in pack["rows"]],
                0.4,
                label=f"torch cat/.to/all_reduce ({pack['torch_backend']})",
            )
            ax.axhline(pack["copy"]["GBps"], linestyle="--", color="gray", label="copy bandwidth")
            ax.set_xticks(list(xs), labels, fontsize="small")
            ax.set_ylabel("GB/s (2 (4 + w) N bytes / time)")
            ax.set_title("packing + unpacking, one rank")
        ax.grid(True, alpha=0.4)
        ax.legend(fontsize="small")
    fig.suptitle(results["meta"]["machine"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


# --------------------------------------------------------------------------------------------- main


def run_in_process_sections(args, plan: Plan, results: dict) -> None:
    """Sections 1 and 2 (one rank) in this process, on one-rank groups over an in-memory store."""
    wanted = [s for s in ("pack", "ddp") if s in args.sections and not (s == "ddp" and plan.ddp_ranks > 1)]
    if not wanted:
        return
    if plan.device.type == "cuda":
        use_gpu_of_rank(0, 1)
        plan = dataclasses.replace(plan, device=torch.device("cuda", torch.cuda.current_device()))
    groups = open_groups(plan.device, dist.HashStore(), 0, 1)
    try:
        for section in wanted:
            print(f"\n== {section} ==", flush=True)
            try:
                results[section] = (
                    run_packing_section(groups, plan) if section == "pack" else run_ddp_section(groups, plan)
                )
            except Exception as error:  # noqa: BLE001  report it, go on with the other sections
                results["errors"][section] = f"{type(error).__name__}: {error}"
                print(f"{section} failed: {error}", file=sys.stderr, flush=True)
    finally:
        Clock(plan.device).settle()
        dist.destroy_process_group()
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()  # leave the GPU's memory to the ranks started next


def main(argv=None) -> int:
    args, plan = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = machine_description(plan.device)
    results: dict = {"meta": meta, "quick": args.quick, "errors": {}}
    run_in_process_sections(args, plan, results)
    if "ddp" in args.sections and plan.ddp_ranks > 1:
        print(f"\n== ddp on {plan.ddp_ranks} spawned ranks ==", flush=True)
        try:
            results["ddp"] = run_ddp_on_spawned_ranks(plan)
        except Exception as error:  # noqa: BLE001
            results["errors"]["ddp"] = f"{type(error).__name__}: {error}"
    if "allreduce" in args.sections:
        print("\n== allreduce (benchmarks/allreduce.py) ==", flush=True)
        try:
            results["allreduce"] = run_allreduce_section(args, plan)
        except Exception as error:  # noqa: BLE001
            results["errors"]["allreduce"] = f"{type(error).__name__}: {error}"
    meta["loadavg_end"] = os.getloadavg()[0]

    report = markdown_report(meta, results, plan)
    print("\n" + report)
    (args.out / "gpu.md").write_text(report + "\n")
    (args.out / "gpu.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"written: {args.out / 'gpu.md'}, {args.out / 'gpu.json'}")
    plot(results, args.out / "gpu.png")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
