"""A data-parallel job for tests/test_network_faults.py, one torchrun per simulated node.

    network_fault_worker.py OUT_DIR --steps N [--timeout S] [--pause S] [--checkpoint]
                            [--raise-at STEP --raise-rank R] [--hook]

Each step trains a small model on a batch that depends only on (rank, step), averages the gradients
with mean_coalesced (the ChainerMN way; quick to start, no DDP), and takes an SGD step, then prints
`step K` and sleeps --pause seconds, so that the test can take a link down while training runs.
With --checkpoint every step is saved with the project's checkpointer and a restarted attempt resumes
from the newest complete one. --raise-at makes rank R raise a Python exception at that step.

Every rank writes OUT_DIR/rank{R}.json: the steps it finished, where it resumed from, the attempt,
and how it ended (the exception's type and text and the wall-clock time it was raised), and
OUT_DIR/params{R}.pt with its parameters when it finished.
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torch_chainermn  # registers the backend


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=5.0, help="the group timeout, seconds")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--raise-at", type=int)
    parser.add_argument("--raise-rank", type=int, default=1)
    parser.add_argument("--hook", action="store_true", help="install the global except hook")
    return parser.parse_args()


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main() -> None:
    args = parse_args()
    if args.hook:
        from torch_chainermn import global_except_hook

        global_except_hook.add_hook()
    dist.init_process_group("chainermn", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    report = {
        "rank": rank,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "steps": 0,
        "resumed_from": 0,
    }
    out = args.out / f"rank{rank}.json"

    def write(**fields):
        report.update(fields)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report))
        os.replace(tmp, out)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpointer = None
    start = 0
    if args.checkpoint:
        checkpointer = torch_chainermn.create_multi_node_checkpointer(
            "job", path=args.out / "checkpoints", cp_interval=1, gc_interval=100
        )
        state, start = checkpointer.maybe_load()
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    write(resumed_from=start, steps=start)
    try:
        for step in range(start, args.steps):
            if step == args.raise_at and rank == args.raise_rank:
                raise RuntimeError(f"a bug in rank {rank}'s training step {step}")
            x, y = batch(rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            torch_chainermn.mean_coalesced([p.grad for p in model.parameters()])
            optimizer.step()
            if checkpointer is not None:
                checkpointer.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step + 1)
            write(steps=step + 1)
            print(f"step {step + 1}", flush=True)
            time.sleep(args.pause)
    except BaseException as error:
        write(error={"type": type(error).__name__, "message": str(error), "at": time.time()})
        raise
    torch.save([p.detach() for p in model.parameters()], args.out / f"params{rank}.pt")
    write(finished=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
