#!/usr/bin/env python
"""Data-parallel training step time: a model with a large gradient and cheap compute, under DDP.

Launched by torchrun (run.py starts one torchrun per simulated node). The model is a stack of
square Linear layers (--params million parameters in all, --layers of them) fed a small random batch,
so the gradient is large (4 bytes per parameter) while the compute stays modest; SGD updates it.

--mode picks how gradients are averaged:

    gloo                     plain DDP on torch's "gloo" backend (the reference)
    gloo+fp16                the same with torch's own fp16_compress_hook
    <strategy>               DDP on the "chainermn" backend with that allreduce communicator
                             (flat, hierarchical, two_dimensional, naive, ...), default hook
    <strategy>+fp16          ... with torch_chainermn.hooks.fp16_compress_hook
    <strategy>+bf16          ... with torch_chainermn.hooks.bf16_compress_hook
    <strategy>+db            ... with double buffering (torch_chainermn.hooks.double_buffering_hook,
                             DoubleBufferingState(compression=None))
    <strategy>+fp16+db       ... double buffering with float16 on the wire
    <strategy>+2bit          ... with gradient compression between nodes (MXNet's 2-bit with error
                             feedback, threshold --threshold): hooks.gradient_compression_hook,
                             GradientCompressionState(code="2bit", threshold=T); the sums come back
                             as float32
    <strategy>+1bit          ... the same with 1-bit sign compression (code="1bit")
    ...+2bit+cr, ...+1bit+cr compress_result=True: the sums come back compressed too
    ...+2bit+fp16            result_dtype=torch.float16: the sums come back as float16 (+bf16: bfloat16;
                             the same for +1bit; not with +cr)
    ...+2bit+db, ...         double buffering of the compressed mean:
                             DoubleBufferingState(compression=GradientCompressionState(...))
    ...+noshm                (chainermn modes) CHAINERMN_SHM=0: a node's ranks meet over Gloo on the
                             node's loopback instead of shared memory

Timing: --warmup steps, a barrier, then --steps timed steps (forward, backward with DDP's
allreduce, optimizer.step). A step's time is measured on every rank; the reported step time is the
median over steps of the slowest rank's time. Afterwards --compute-steps steps run under no_sync()
(no communication at all) to measure the compute alone, and --comm-steps rounds of all_reduce of
the gradient's buckets in the wire dtype (no compute; for compressed modes the compressed mean,
GradientCompression.start on float32 buffers of the buckets' sizes, after one untimed round that
allocates its residuals) measure the communication alone; the CPU time
of every rank process during the timed steps is reported too (cpu_per_step_s, summed over ranks).
Rank 0 prints one JSON line and, with --json, writes it to that file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

T_START = time.time()
import torch
import torch.distributed as dist
import torch.nn as nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="hierarchical")
    p.add_argument("--params", type=float, default=25.0, help="million parameters (all in the Linear layers)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compute-steps", type=int, default=3, help="steps without communication (0: skip)")
    p.add_argument(
        "--comm-steps",
        type=int,
        default=1,
        help="rounds of allreduce alone (the gradient's buckets, wire dtype; 0: skip)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threshold", type=float, default=0.5, help="2-bit compression's threshold (+2bit modes)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=300.0, help="process group timeout, seconds")
    p.add_argument("--json", default=None, help="rank 0 writes its result here")
    return p.parse_args(argv)


def parse_mode(mode: str):
    parts = mode.split("+")
    base, flags = parts[0], set(parts[1:])
    unknown = flags - {"fp16", "bf16", "db", "noshm", "2bit", "1bit", "cr"}
    if unknown or ("fp16" in flags and "bf16" in flags):
        raise SystemExit(f"bad mode {mode!r}: flags are +fp16, +bf16, +db, +noshm, +2bit, +1bit, +cr")
    if "2bit" in flags and "1bit" in flags:
        raise SystemExit(f"bad mode {mode!r}: +2bit or +1bit, not both")
    if "cr" in flags and not flags & {"2bit", "1bit"}:
        raise SystemExit(f"bad mode {mode!r}: +cr (compress_result) needs +2bit or +1bit")
    if "cr" in flags and flags & {"fp16", "bf16"}:
        raise SystemExit(f"bad mode {mode!r}: with +cr the sums come back compressed, not as fp16/bf16")
    if base == "gloo" and flags & {"2bit", "1bit"}:
        raise SystemExit("gradient compression (+2bit, +1bit) is a torch_chainermn hook: use a chainermn strategy")
    if base == "gloo" and "bf16" in flags:
        raise SystemExit("gloo+bf16: torch's bf16_compress_hook needs CUDA and NCCL; use gloo+fp16")
    if base == "gloo" and "noshm" in flags:
        raise SystemExit("+noshm is a chainermn setting (CHAINERMN_SHM=0)")
    if base == "gloo" and "db" in flags:
        raise SystemExit("double buffering (+db) is a torch_chainermn hook: use a chainermn strategy")
    return base, flags


def build_model(params_m: float, layers: int) -> tuple[nn.Module, int]:
    width = int(math.sqrt(params_m * 1e6 / layers))
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods), width


def compression_settings(flags: set, threshold: float) -> dict | None:
    """GradientCompressionState's settings for a compressed mode (+2bit, +1bit), else None."""
    kind = "2bit" if "2bit" in flags else "1bit" if "1bit" in flags else None
    if kind is None:
        return None
    result = torch.float16 if "fp16" in flags else torch.bfloat16 if "bf16" in flags else torch.float32
    return {"code": kind, "threshold": threshold, "compress_result": "cr" in flags, "result_dtype": result}


def install_hook(model, base: str, flags: set, threshold: float = 0.5):
    """Register the comm hook of the mode; returns the double-buffering state (or None)."""
    if base == "gloo":
        if "fp16" in flags:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if not flags - {"noshm"}:
        return None  # DDP's own allreduce on the chainermn group
    import torch_chainermn.hooks as hooks

    compression = compression_settings(flags, threshold)
    if compression is not None:
        state = hooks.GradientCompressionState(process_group=None, **compression)
        if "db" in flags:
            db = hooks.DoubleBufferingState(compression=state)
            model.register_comm_hook(db, hooks.double_buffering_hook)
            return db
        model.register_comm_hook(state, hooks.gradient_compression_hook)
        return None
    wire = torch.float16 if "fp16" in flags else torch.bfloat16 if "bf16" in flags else None
    if "db" in flags:
        state = hooks.DoubleBufferingState(process_group=None, compression=wire)
        model.register_comm_hook(state, hooks.double_buffering_hook)
        return state
    model.register_comm_hook(None, hooks.fp16_compress_hook if wire == torch.float16 else hooks.bf16_compress_hook)
    return None


def main(argv=None) -> int:
    global T_IMPORTED
    T_IMPORTED = time.time()
    args = parse_args(argv)
    base, flags = parse_mode(args.mode)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from datetime import timedelta

    timeout = timedelta(seconds=args.timeout)
    if base == "gloo":
        dist.init_process_group("gloo", timeout=timeout)
    else:
        if "noshm" in flags:
            os.environ["CHAINERMN_SHM"] = "0"  # the node's ranks meet over Gloo, not shared memory
        import torch_chainermn

        dist.init_process_group("chainermn", timeout=timeout, pg_options=torch_chainermn.Options(communicator=base))
    rank, world = dist.get_rank(), dist.get_world_size()
    phases = {"import": T_IMPORTED - T_START, "init": time.time() - T_IMPORTED}
    t_phase = time.time()

    model, width = build_model(args.params, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    # Every rank built the same parameters from seed 0, so DDP's start-up broadcast of 4 bytes per
    # parameter (seconds on a slow link, and not part of a training step) is skipped.
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb, init_sync=False)
    db_state = install_hook(ddp, base, flags, args.threshold)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, width, generator=gen)
    y = torch.randn(args.batch, width, generator=gen)
    loss_fn = nn.MSELoss()

    def step(model_ctx=None):
        opt.zero_grad(set_to_none=False)
        if model_ctx is None:
            loss = loss_fn(ddp(x), y)
            loss.backward()
        else:
            with model_ctx():
                loss = loss_fn(ddp(x), y)
                loss.backward()
        opt.step()
        return loss

    phases["model"] = time.time() - t_phase
    t_phase = time.time()
    for _ in range(args.warmup):
        step()
    dist.barrier()
    phases["warmup"] = time.time() - t_phase
    times = []
    t_start = time.perf_counter()
    cpu_start = time.process_time()  # this process, every thread (the backend's workers too)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    cpu = time.process_time() - cpu_start
    if db_state is not None:
        db_state.flush()
    dist.barrier()

    phases["timed"] = time.perf_counter() - t_start
    t_phase = time.time()
    compute = []
    cpu_start = time.process_time()
    for _ in range(args.compute_steps):
        t0 = time.perf_counter()
        step(ddp.no_sync)
        compute.append(time.perf_counter() - t0)
    compute_cpu = time.process_time() - cpu_start
    dist.barrier()
    phases["compute"] = time.time() - t_phase

    # The communication alone: the gradient's size in buckets, in the wire dtype, no compute.
    t_phase = time.time()
    compression = compression_settings(flags, args.threshold)
    wire = torch.float16 if "fp16" in flags else torch.bfloat16 if "bf16" in flags else torch.float32
    if compression is not None:
        wire = torch.float32  # compressed modes: float32 gradients, compressed in the backend
    per_bucket = int(args.bucket_cap_mb * 2**20 / 4)
    bufs = [torch.zeros(min(per_bucket, n_params - i), dtype=wire) for i in range(0, n_params, per_bucket)]

    if compression is None:

        def comm_round():
            for w in [dist.all_reduce(b, async_op=True) for b in bufs]:
                w.wait()
    else:
        # The compressed mean of each bucket, as the hook runs it (one GradientCompression per buffer,
        # so each keeps one layout and its own residual; the training state's residuals stay untouched).
        from torch_chainermn.compression import GradientCompression

        compressors = [GradientCompression(None, **compression) for _ in bufs]

        def comm_round():
            works = [c.start([b], ((id(b), 0, b.numel()),)) for c, b in zip(compressors, bufs)]
            for w in works:
                w.wait()

        if args.comm_steps:
            comm_round()  # allocates the residuals (a first step's cost, not a step's)
    comm = []
    comm_cpu = 0.0
    dist.barrier()  # the connections and buffers are warm from training
    for i in range(args.comm_steps):
        t0 = time.perf_counter()
        c0 = time.process_time()
        comm_round()
        comm.append(time.perf_counter() - t0)
        comm_cpu += time.process_time() - c0
    dist.barrier()
    phases["comm"] = time.time() - t_phase

    mine = {
        "rank": rank,
        "host": os.environ.get("CHAINERMN_HOSTNAME", socket.gethostname()),
        "times": times,
        "wall": wall,
        "cpu": cpu,
        "compute": compute,
        "comm": comm,
        "compute_cpu": compute_cpu,
        "comm_cpu": comm_cpu,
        "loss": float(loss.detach()),
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        slowest = [max(r["times"][i] for r in everyone) for i in range(args.steps)]
        step_s = statistics.median(slowest)
        compute_s = (
            statistics.median([max(r["compute"][i] for r in everyone) for i in range(args.compute_steps)])
            if args.compute_steps
            else None
        )
        comm_s = (
            statistics.median([max(r["comm"][i] for r in everyone) for i in range(args.comm_steps)])
            if args.comm_steps
            else None
        )
        transport = None
        if base != "gloo":
            import torch_chainermn

            transport = torch_chainermn.transport()
        result = {
            "mode": args.mode,
            "world_size": world,
            "nodes": len({r["host"] for r in everyone}),
            "params": n_params,
            "grad_mb": n_params * 4 / 1e6,
            "width": width,
            "layers": args.layers,
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "transport": transport,
            "compression": ({**compression, "result_dtype": str(compression["result_dtype"])} if compression else None),
            "step_s": step_s,
            "step_min_s": min(slowest),
            "step_max_s": max(slowest),
            "wall_per_step_s": max(r["wall"] for r in everyone) / args.steps,
            "compute_s": compute_s,
            "comm_s": comm_s,
            # CPU seconds per step, summed over the ranks: how many cores the job kept busy
            "cpu_per_step_s": sum(r["cpu"] for r in everyone) / args.steps,
            "compute_cpu_per_step_s": (
                sum(r["compute_cpu"] for r in everyone) / args.compute_steps if args.compute_steps else None
            ),
            "comm_cpu_per_round_s": sum(r["comm_cpu"] for r in everyone) / args.comm_steps if args.comm_steps else None,
            "step_times_s": [round(t, 3) for t in slowest],
            "samples_per_s": world * args.batch / step_s,
            "loss": float(loss.detach()),
            "phases_s": {k: round(v, 2) for k, v in phases.items()},
        }
        line = json.dumps(result)
        print("RESULT " + line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
