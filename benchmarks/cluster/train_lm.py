#!/usr/bin/env python
"""One rank of the language-model task (lm.py) on the simulated cluster: train until the validation
loss reaches --target-loss, or the step or time budget runs out.

Launched by torchrun, one per node namespace (run.py --task lm). --mode picks how the replicas
meet; AdamW (the same learning rate and warm-up) is the inner optimizer of every mode:

    gloo        DDP on init_process_group("gloo")
    chainermn   DDP on init_process_group("chainermn") (its default, hierarchical communicator)
    fp16+db     chainermn DDP, hooks.double_buffering_hook with DoubleBufferingState(compression=float16)
    fp16+db+dc  the same with DC-ASGD's delay compensation (delay_compensation.py, --dc-lambda)
    db          double buffering with a float32 wire
    2bit, 1bit  chainermn DDP, hooks.gradient_compression_hook, GradientCompressionState(code=...,
                threshold=--threshold); +cr: compress_result=True (the sums come back compressed too)
    int8, 4bit  the same hook with the block codes (one scale per --block values, error feedback);
                +cr: the sums come back compressed too; 4bit+int8: 4 bits there, the sums back in int8
    overlap     chainermn DDP, torch_chainermn.OverlapNextForward: the exchange runs on into the next
                forward, each module stepped when its own parameters' mean arrives (DDP's result);
                overlap+int8, overlap+4bit: with that code between nodes (compress_result)
    powersgd    chainermn DDP, torch's PowerSGD hook (rank --powersgd-rank, plain allreduce for the
                first --powersgd-start steps)
    localsgd    one replica per node (DDP over torch_chainermn.node_group(): gradients averaged in the
                node only), parameters averaged over the world every --sync-every steps
    diloco      the same replicas, DiLoCo: every H steps the outer gradient is averaged in float32 and
                SGD (--outer-lr; Nesterov with --outer-momentum > 0) steps on it
    streaming   Streaming DiLoCo: --fragments fragments at staggered steps, each exchange in flight
                for --fragment-delay steps, --outer-code with compress_result between nodes (2bit:
                threshold --outer-threshold; topk: --outer-keep of every --outer-block values)
    diloco+topk, streaming+topk  the same with the top-k code between nodes (--outer-keep of every
                --outer-block values, error feedback; SparseLoCo's outer gradients)
    diloco+4bit, streaming+4bit  ... with the 4-bit block code (one scale per --outer-block values)
    diloco+eager, diloco+4bit+eager, diloco+topk+eager  DiLoCo with eager outer updates: each
                exchange runs during the next round, the replica's own outer gradient stands in for
                its share of the mean until it arrives (docs/low-communication.md)
    streaming-ranks  the same with every rank a replica of its own (no DDP in the node: no
                communication at all between syncs; the backend still sums a node's outer
                gradients in the node and sends one compressed copy per node)
    fsdp-gloo   FSDP2 (fully_shard on every block and the root) on init_process_group("gloo")
    fsdp        FSDP2 on init_process_group("chainermn"), its own collectives
    fsdp-2hop   ... with torch_chainermn.fsdp.two_hop(model): in the node, then between nodes
    fsdp-int8   ... with compress_between_nodes(model, compression={"code": "int8"}, weights="int8")
    fsdp-int8-hpz  ... and reshard_after_forward=<ranks per node> (hpZ: the backward all-gather
                stays in the node)
    fsdp-2bit   ... gradients="2bit" (threshold --fsdp-threshold), weights="float32"
    fsdp-2bit-int8, fsdp-2bit-int8-hpz  ... 2-bit gradients, int8 weights (and hpZ)
    fsdp-1bit-int8-hpz  ... 1-bit gradients (sign x mean magnitude), int8 weights, hpZ

The clock: training wall time, paused while the validation loss is measured (after every exchange
still in flight has been waited for, on the clock: no mode's traffic runs on in the paused time). Every --eval-every
steps (and at the end) the ranks stop the clock, meet on a separate Gloo group (so nothing queued
on the training group delays the meeting), and measure the validation loss: each node evaluates its
own replica on the fixed validation windows, split among its ranks, and the loss reported is the
mean over nodes (in DDP modes all replicas are equal; in localsgd/diloco the evaluations fall right
after a sync when --eval-every is a multiple of --sync-every; streaming's fragments never all agree,
so its loss is the replicas' mean). Between evaluations the ranks also meet when the time budget
may run out, at a step they all compute from the clock agreed at the last meeting, so a slow mode
stops within about a step of the budget without a collective every step.

Also measured: bytes sent between nodes (each node's eth0 tx_bytes, read by its local rank 0 before
the first and after the last step; every rank runs in its node's namespace, so that is the node's
traffic), the same by the backend's own counters (torch_chainermn.counters(): what the chainermn
groups' ops sent between nodes, summed over the node's ranks; reset at the first step) with the
interface's bytes over them, which must lie within the share of TCP/IP's headers (1 to
1 + 2 x 66 / MSS: a header per segment sent, and at most one ACK per segment received), and the compute alone: --compute-steps steps at the end with no communication at all
(DDP's no_sync, outside the DiLoCo/LocalSGD context), the median of the slowest rank's times; the
time before the first step (from the process's start, the first evaluation left out; the slowest
rank's) and its parts; the waits at the meetings for exchanges still in flight (flush_s).
Rank 0 writes one JSON object to --json.

--profile-dir DIR: every rank profiles --profile-steps steps from step --profile-start with
torch.profiler and writes its Chrome trace to DIR/rank<R>.json (`python -m torch_chainermn.timeline
DIR` draws them, docs/observability.md). Writing the traces takes time on the training clock: a
profiled run's times are not for the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm  # noqa: E402

DDP_MODES = (
    "gloo",
    "chainermn",
    "db",
    "fp16+db",
    "fp16+db+dc",
    "2bit",
    "1bit",
    "2bit+cr",
    "1bit+cr",
    "int8",
    "4bit",
    "int8+cr",
    "4bit+cr",
    "4bit+int8",
    "powersgd",
    "overlap",
    "overlap+int8",
    "overlap+4bit",
)
CODE_MODES = ("2bit", "1bit", "2bit+cr", "1bit+cr", "int8", "4bit", "int8+cr", "4bit+cr", "4bit+int8")
# Replicas synced every H steps; "+topk": that code for the outer gradients (else streaming's --outer-code).
# "+eager": DiLoCo's eager outer updates (each exchange in flight for the next round).
LOCAL_MODES = (
    "localsgd",
    "diloco",
    "streaming",
    "streaming-ranks",
    "diloco+topk",
    "streaming+topk",
    "diloco+4bit",
    "streaming+4bit",
    "diloco+eager",
    "diloco+4bit+eager",
    "diloco+topk+eager",
)
FSDP_MODES = (
    "fsdp-gloo",
    "fsdp",
    "fsdp-2hop",
    "fsdp-int8",
    "fsdp-int8-hpz",
    "fsdp-2bit",
    "fsdp-2bit-int8",
    "fsdp-2bit-int8-hpz",
    "fsdp-1bit-int8-hpz",
)  # sharded, no compute-alone phase
MODES = DDP_MODES + LOCAL_MODES + FSDP_MODES
TX_BYTES = Path("/sys/class/net/eth0/statistics/tx_bytes")


def add_method_args(p: argparse.ArgumentParser) -> None:
    """The modes' settings (shared with the driver, lm_task.py, which passes them through)."""
    # 2-bit compresses a node's SUM of its ranks' gradients. Measured with lm.py (one process, batch
    # 16 and 32, steps 30-200): mean |gradient| 2.3e-4 to 3.9e-4 per rank, median 1e-4, 90th
    # percentile 5e-4, 99th 3e-3; a node's sum of 2 ranks is about twice that. With AdamW every
    # threshold tried diverged or stalled on this task (1e-4, 2e-4, 5e-4 on the cluster; 2e-5 and
    # 2e-3 in a one-process simulation of the same error feedback): 2e-3, at the sum's 99th
    # percentile, is the one that did not blow up (codes fire rarely). See the README.
    p.add_argument("--threshold", type=float, default=2e-3, help="2-bit threshold for the gradients")
    p.add_argument("--block", type=int, default=256, help="values per scale of the int8 and 4bit codes")
    p.add_argument("--dc-lambda", type=float, default=1.0, help="fp16+db+dc: DC-ASGD's lambda")
    # FSDP2 averages (ReduceOp.AVG): the node's value that 2-bit codes is the mean of its ranks'
    # gradients, half the DDP hook's sum, so half its threshold.
    p.add_argument("--fsdp-threshold", type=float, default=1e-3, help="2-bit threshold for FSDP's gradients")
    # DiLoCo's outer gradient over H=16 AdamW steps at lr 2e-3: mean |global - local| 2e-3 to 4e-3,
    # median 1e-3, 90th percentile 5e-3 (lm.py); each node's two ranks hold the same one, so the
    # node sum that is compressed is twice that: 5e-3, about its mean. At H=8 (smaller outer
    # gradients: more is held back a round) streaming still reached 2.58 after 160 steps.
    p.add_argument(
        "--outer-threshold", type=float, default=5e-3, help="2-bit threshold for streaming's outer gradients"
    )
    p.add_argument(
        "--outer-code", default="2bit", help="streaming's code for the outer gradients: 2bit, topk, int8, 4bit"
    )
    p.add_argument("--outer-block", type=int, default=256, help="values per block of streaming's topk/int8/4bit code")
    p.add_argument("--outer-keep", type=int, default=8, help="values kept per block by streaming's topk code")
    # H=8: a budget of 160 steps leaves DiLoCo 10 outer steps at H=16 (with a 4-layer model it was
    # at 2.75 after 200 steps where DDP was at 2.44); H=8 gives 20 and still sends 1/4 of DDP's
    # bytes per step.
    p.add_argument(
        "--sync-every", type=int, default=8, help="H: inner steps between syncs (localsgd, diloco, streaming)"
    )
    p.add_argument("--fragments", type=int, default=2, help="F: streaming's fragments")
    p.add_argument(
        "--fragment-delay", type=int, default=2, help="tau: steps a fragment's exchange is in flight (< H/F)"
    )
    p.add_argument(
        "--fragment-alpha",
        type=float,
        default=0.5,
        help="streaming: the share of its own value a fragment keeps at the merge (fragment_update_alpha)",
    )
    p.add_argument(
        "--buckets",
        type=int,
        default=0,
        help="DDP's buckets, about this many (bucket_cap_mb = the gradient's size / this); 0: DDP's "
        "default 25 MB (one bucket here), 8 for the overlap modes",
    )
    p.add_argument("--outer-lr", type=float, default=0.8)
    # Plain SGD (no momentum) at 0.8: the paper's Nesterov 0.9 is for H=500 and thousands of steps;
    # with H=8 and 20 outer steps any momentum overshoots (2026-11-28, 160 steps: Nesterov 0.7/0.9
    # 2.92, 0.7/0.5 2.61, SGD 1.0 2.53 = LocalSGD, SGD 0.8 2.41; at H=1 Nesterov 0.7/0.5 gave 2.63
    # where SGD 1.0 gives DDP's 2.44). docs/low-communication.md has the runs.
    p.add_argument("--outer-momentum", type=float, default=0.0, help="Nesterov momentum when > 0, else plain SGD")
    p.add_argument(
        "--replica-start",
        choices=["same", "broadcast"],
        default="same",
        help="localsgd/diloco/streaming: 'same' (every rank built the model from seed 0: proved by "
        "checksums, nothing broadcast) or 'broadcast' (rank 0's model over the link)",
    )
    p.add_argument(
        "--diloco-warmup",
        type=int,
        default=0,
        help="DiLoCo's warm start (diloco, streaming): the first N steps are DDP's (warmup_steps)",
    )
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start", type=int, default=10, help="steps of plain allreduce before PowerSGD")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    """Profiling a few steps of every rank (shared with the driver, lm_task.py)."""
    p.add_argument(
        "--profile-dir",
        default=None,
        help="every rank writes torch.profiler's Chrome trace of the profiled steps to DIR/rank<R>.json",
    )
    p.add_argument("--profile-start", type=int, default=4, help="the first profiled step (from 1)")
    p.add_argument("--profile-steps", type=int, default=2, help="how many steps are profiled")


def step_profiler(args, rank: int):
    """torch.profiler over steps --profile-start .. of this rank (call .step() after every step), or
    None without --profile-dir. The step before the first is the profiler's warm-up: starting it
    takes a rank a fraction of a second, which would otherwise make the first profiled op's
    stragglers the ranks whose profiler started last."""
    if not args.profile_dir:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    if args.profile_start < 2:
        raise SystemExit("--profile-start must be 2 or more (the step before it warms the profiler up)")
    path = Path(args.profile_dir) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # record_shapes: the ops' shapes and the phases' transports and bytes (docs/observability.md).
    return profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=args.profile_start - 2, warmup=1, active=args.profile_steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="chainermn")
    lm.add_model_args(p)
    add_method_args(p)
    add_profile_args(p)
    p.add_argument("--steps", type=int, default=160, help="step budget")
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds of training clock (0: none)")
    p.add_argument("--target-loss", type=float, required=True)
    p.add_argument("--stop-at-target", action="store_true", help="stop at the first evaluation at or below the target")
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--compute-steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0, help="process group timeout, seconds")
    p.add_argument("--json", default=None, help="rank 0 writes its result here")
    return p.parse_args(argv)


def setup(args, model):
    """(the module to call in training, the inner optimizer, the mode's context manager, a function
    that completes communication still in flight)."""
    if args.mode in FSDP_MODES:
        return setup_fsdp(args, model)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.mode in LOCAL_MODES:
        import torch_chainermn
        from torch_chainermn.hooks import GradientCompressionState

        if args.mode == "streaming-ranks":
            ddp = model  # every rank its own replica
        else:
            # One replica per node. Every rank built the same parameters from seed 0: no start-up
            # broadcast (init_sync=False).
            ddp = DDP(model, process_group=torch_chainermn.node_group(), init_sync=False)
        if args.mode == "localsgd":
            local_sgd = torch_chainermn.LocalSGD(ddp, inner, sync_every=args.sync_every, start=args.replica_start)
            return ddp, inner, local_sgd, local_sgd.flush
        outer = torch.optim.SGD(
            model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=args.outer_momentum > 0
        )
        eager = args.mode.endswith("+eager")
        base = args.mode.removesuffix("+eager")
        streaming = base.startswith("streaming")
        code = base.partition("+")[2] or (args.outer_code if streaming else None)
        compression = (
            GradientCompressionState(
                code=code,
                threshold=args.outer_threshold,
                block=args.outer_block,
                keep=args.outer_keep,
                compress_result=True,
            )
            if code
            else None
        )
        diloco = torch_chainermn.DiLoCo(
            ddp,
            inner,
            outer,
            sync_every=args.sync_every,
            process_group=None,
            fragments=args.fragments if streaming else 1,
            fragment_delay=args.fragment_delay if streaming else 0,
            compression=compression,
            warmup_steps=args.diloco_warmup,
            fragment_update_alpha=args.fragment_alpha,
            start=args.replica_start,
            eager=eager,
        )
        return ddp, inner, diloco, diloco.flush
    # The overlap needs several buckets to overlap anything: about 8 of them, whatever the model's size.
    buckets = args.buckets or (8 if args.mode.startswith("overlap") else 0)
    if buckets:
        grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        ddp = DDP(model, init_sync=False, bucket_cap_mb=grad_mb / buckets)
    else:
        ddp = DDP(model, init_sync=False)
    flush = lambda: None  # noqa: E731
    if args.mode.startswith("overlap"):
        import torch_chainermn
        from torch_chainermn import hooks

        code = args.mode.partition("+")[2]
        compression = (
            hooks.GradientCompressionState(code=code, block=args.block, compress_result=True) if code else None
        )
        overlap = torch_chainermn.OverlapNextForward(
            ddp, torch.optim.AdamW, compression=compression, lr=args.lr, weight_decay=args.weight_decay
        )
        return ddp, overlap, contextlib.nullcontext(), overlap.finish
    if args.mode in ("fp16+db", "fp16+db+dc", "db"):
        from torch_chainermn import hooks

        state = hooks.DoubleBufferingState(compression=torch.float32 if args.mode == "db" else torch.float16)
        if args.mode.endswith("+dc"):
            import delay_compensation as dc

            ddp.register_comm_hook(dc.DelayCompensation(state, args.dc_lambda), dc.delay_compensated_hook)
        else:
            ddp.register_comm_hook(state, hooks.double_buffering_hook)
        flush = state.flush
    elif args.mode in CODE_MODES:
        from torch_chainermn import hooks

        code, _, sums = args.mode.partition("+")
        state = hooks.GradientCompressionState(
            code=code,
            threshold=args.threshold,
            compress_result={"": False, "cr": True}.get(sums, sums),
            block=args.block,
        )
        ddp.register_comm_hook(state, hooks.gradient_compression_hook)
    elif args.mode == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank, start_powerSGD_iter=args.powersgd_start
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp, inner, contextlib.nullcontext(), flush


def setup_fsdp(args, model):
    """FSDP2 on every block and the root, on the default group; the optimizer over the shards."""
    from torch.distributed.fsdp import fully_shard

    reshard = int(os.environ["LOCAL_WORLD_SIZE"]) if args.mode.endswith("-hpz") else True
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    if args.mode != "fsdp-gloo" and args.mode != "fsdp":
        import torch_chainermn.fsdp

        parts = args.mode.split("-")[1:]  # e.g. ["2bit", "int8", "hpz"]
        gradients = next((p for p in parts if p in ("int8", "2bit", "1bit")), "float32")
        weights = "int8" if "int8" in parts else "float32"
        coded = {"code": gradients, "threshold": args.fsdp_threshold}
        torch_chainermn.fsdp.compress_between_nodes(
            model, compression=None if gradients == "float32" else coded, weights=weights
        )
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return model, inner, contextlib.nullcontext(), lambda: None


def chainermn_groups() -> list:
    """The process groups of this job that use the chainermn backend (the training's, and any the mode
    made for itself), not the Gloo side group."""
    groups = dist.distributed_c10d._world.pg_map
    return [g for g in groups if dist.get_backend(g) == "chainermn"]


def reset_counted() -> None:
    """counted_tx_bytes() from now on."""
    for g in chainermn_groups():
        import torch_chainermn

        torch_chainermn.reset_counters(g)


def counted_tx_bytes() -> int:
    """This rank's bytes sent between nodes by the chainermn groups' ops, by the backend's counters."""
    if not chainermn_groups():
        return 0
    import torch_chainermn

    return sum(
        cell["bytes_sent"]
        for g in chainermn_groups()
        for cell in torch_chainermn.counters(g).get("between_nodes", {}).values()
    )


def header_bound() -> float:
    """The interface's bytes over the payload's at most: each segment of MSS payload bytes carries 66
    bytes of Ethernet, IPv4 and TCP headers (with timestamps), and at most one ACK of 66 bytes goes
    back per segment received (a node receives about what it sends)."""
    mss = int(Path("/sys/class/net/eth0/mtu").read_text()) - 52
    return 1 + 2 * 66 / mss


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time), so that the time
    before the first step includes the interpreter's start and `import torch`."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def node_tx_bytes(local_rank: int) -> int:
    """This node's bytes sent on its link so far (local rank 0 reads it; the others say 0)."""
    return int(TX_BYTES.read_text()) if local_rank == 0 else 0


def main(argv=None) -> int:
    t_main = time.time()  # the interpreter is up and torch imported
    t_start = t_main - process_age_s()  # the process's start
    args = parse_args(argv)
    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    if args.mode in ("gloo", "fsdp-gloo"):
        dist.init_process_group("gloo", timeout=timeout)
    else:
        import torch_chainermn  # noqa: F401  (registers the backend)

        dist.init_process_group("chainermn", timeout=timeout)
    t_init = time.time()  # the process group is up
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    side = dist.new_group(backend="gloo")  # the clock and the evaluations meet here

    corpus = lm.load_corpus(args.corpus_mb)
    model = lm.build(args)
    n_params = sum(p.numel() for p in model.parameters())
    t_setup = time.time()
    train_model, inner, context, flush = setup(args, model)
    setup_s = time.time() - t_setup
    data = lm.batches(corpus.train, args.batch, args.context, seed=1000 + rank)
    # This node's ranks split the validation windows; every node evaluates its own replica.
    mine = lm.validation_windows(corpus.val, args.val_windows, args.context)[local_rank::local_size]
    n_nodes = world // local_size

    def meet(clock: float) -> float:
        """The clock of the slowest rank (all ranks wait here)."""
        t = torch.tensor([clock], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=side)
        return float(t)

    def validation_loss() -> float:
        total, count = lm.validation_loss_sum(model, mine)
        t = torch.tensor([total, count], dtype=torch.float64)
        dist.all_reduce(t, group=side)
        return float(t[0] / t[1])  # every node evaluated all windows: the mean over replicas

    t_eval0 = time.time()
    history = [{"step": 0, "clock_s": 0.0, "val_loss": validation_loss()}]
    eval0_s = time.time() - t_eval0  # the benchmark's own evaluation: not part of the start
    eval_s = 0.0
    reached = None
    steps = 0
    clock = 0.0
    flush_s = 0.0  # this rank's waits for exchanges still in flight at the meetings (on the clock)
    startup_s = time.time() - t_start
    profiler = step_profiler(args, rank)
    with context, profiler if profiler is not None else contextlib.nullcontext():
        dist.barrier(group=side)
        tx_start = node_tx_bytes(local_rank)
        reset_counted()
        next_meeting = 1
        # Time before the first step: from the process's start to here, the first evaluation left out.
        first_step_s = time.time() - t_start - eval0_s
        segment = time.perf_counter()
        while steps < args.steps:
            for group in inner.param_groups:
                group["lr"] = lm.learning_rate(steps, args.lr, args.warmup)
            x, y = next(data)
            loss = lm.loss_of(train_model, x, y)
            loss.backward()
            inner.step()
            inner.zero_grad(set_to_none=True)
            steps += 1
            if profiler is not None:
                profiler.step()
            if steps != next_meeting and steps != args.steps:
                continue
            # An exchange still in flight is waited for on the clock: the link must not get the
            # evaluation's paused time for free (an asynchronous mode's exchange would run on in it).
            t_flush = time.perf_counter()
            flush()
            flush_s += time.perf_counter() - t_flush
            clock = meet(clock + time.perf_counter() - segment)
            t_eval = time.perf_counter()
            out_of_time = args.time_budget > 0 and clock >= args.time_budget
            if steps % args.eval_every == 0 or out_of_time or steps == args.steps:
                history.append({"step": steps, "clock_s": clock, "val_loss": validation_loss(), "flush_s": flush_s})
                if reached is None and history[-1]["val_loss"] <= args.target_loss:
                    reached = history[-1]
                if rank == 0:
                    print(f"step {steps}: val {history[-1]['val_loss']:.3f}, clock {clock:.1f} s", flush=True)
            if out_of_time or (reached is not None and args.stop_at_target):
                eval_s += time.perf_counter() - t_eval
                break
            # The next meeting: the next evaluation, or earlier if the budget may run out before it
            # (every rank computes the same step from the agreed clock).
            next_meeting = (steps // args.eval_every + 1) * args.eval_every
            if args.time_budget > 0:
                left = int((args.time_budget - clock) / (clock / steps))
                next_meeting = min(next_meeting, steps + max(1, left))
            eval_s += time.perf_counter() - t_eval
            segment = time.perf_counter()
        flush()
    dist.barrier(group=side)
    tx = node_tx_bytes(local_rank) - tx_start
    counted = counted_tx_bytes()

    # The compute alone: the same steps with no communication (no DDP sync, no DiLoCo hook).
    compute = []
    # FSDP2 cannot step without its all-gathers: no compute-alone phase (the DDP modes' is the same compute).
    for _ in range(0 if args.mode in FSDP_MODES else args.compute_steps):
        dist.barrier(group=side)
        t0 = time.perf_counter()
        with train_model.no_sync() if isinstance(train_model, DDP) else contextlib.nullcontext():
            x, y = next(data)
            lm.loss_of(train_model, x, y).backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        compute.append(time.perf_counter() - t0)

    everyone = [None] * world
    dist.all_gather_object(
        everyone,
        {
            "tx": tx,
            "counted": counted,
            "compute": compute,
            "host": os.environ.get("CHAINERMN_HOSTNAME"),
            "first_step": first_step_s,
            "init": t_init - t_start,
            "setup": setup_s,
            "imports": t_main - t_start,
        },
        group=side,
    )
    if rank == 0:
        compute_s = (
            statistics.median(max(r["compute"][i] for r in everyone) for i in range(args.compute_steps))
            if args.compute_steps and compute
            else None
        )
        tx_total = sum(r["tx"] for r in everyone)
        counted_total = sum(r["counted"] for r in everyone)
        ratio = tx_total / counted_total if counted_total else None
        if ratio is not None:
            print(
                f"between nodes: interface {tx_total / 1e6:.3f} MB, counters {counted_total / 1e6:.3f} MB, "
                f"ratio {ratio:.4f} (headers' bound 1 to {header_bound():.4f}: "
                f"{'within' if 1 <= ratio <= header_bound() else 'OUTSIDE'})",
                flush=True,
            )
        result = {
            "mode": args.mode,
            "world_size": world,
            "nodes": n_nodes,
            "params": n_params,
            "grad_mb": n_params * 4 / 1e6,
            "corpus": corpus.describe(),
            "corpus_sha": corpus.digest,
            "settings": {
                k: v for k, v in vars(args).items() if k not in ("json", "mode") and not k.startswith("profile_")
            },  # as before profiling
            "steps": steps,
            "clock_s": clock,
            "tokens": steps * world * args.batch * args.context,
            "reached": reached is not None,
            "steps_to_target": reached["step"] if reached else None,
            "time_to_target_s": reached["clock_s"] if reached else None,
            "final_val_loss": history[-1]["val_loss"],
            "history": history,
            "tx_bytes": tx_total,
            "bytes_per_step": tx_total / max(1, steps),
            "counted_tx_bytes": counted_total,
            "tx_over_counted": ratio,
            "header_bound": header_bound(),
            "compute_s": compute_s,
            "utilisation": steps * compute_s / clock if compute_s and clock else None,
            "step_s": clock / max(1, steps),
            "eval_s": eval_s,
            "startup_s": startup_s,
            # The slowest rank's time from its process's start to its first step (the first
            # evaluation left out), and its parts: up to init_process_group's return, the mode's set-up
            # (DDP / DiLoCo / LocalSGD constructors: where a start-up broadcast would cross the link);
            # imports: the interpreter's start and `import torch`, before main() (the machine's load).
            "first_step_s": max(r["first_step"] for r in everyone),
            "init_s": max(r["init"] for r in everyone),
            "setup_s": max(r["setup"] for r in everyone),
            "imports_s": max(r["imports"] for r in everyone),
            # Rank 0's waits at the meetings for an exchange still in flight (eager DiLoCo's exchange
            # is always in flight: each evaluation makes it wait for one exchange that compute
            # would otherwise hide), in all and up to the target's evaluation.
            "flush_s": flush_s,
            "flush_to_target_s": reached["flush_s"] if reached else None,
        }
        line = json.dumps(result)
        print("RESULT " + line, flush=True)
        if args.json:
            Path(args.json).write_text(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
