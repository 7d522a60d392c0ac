"""A training script that meets old group instances in the store, run by tests/test_group_instances.py.

    elastic_worker.py OUT_DIR

Every attempt first re-creates its groups in the same processes (destroy_process_group, then
init_process_group and new_group again: torch gives the new groups the old names and store prefixes).
The first process that is rank 1 then dies after an all_reduce, once per job (a marker file in OUT_DIR
says it has), so the launcher restarts the workers against the store that still holds the first
attempt's keys. The attempt that survives trains a small model data-parallel and checkpoints it; rank 0
writes OUT_DIR/result.json.
"""

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import torch_chainermn  # registers the backend

TIMEOUT = datetime.timedelta(seconds=20)
REINITS = 3
STEPS = 5


def check_groups_once(rank: int, world: int) -> None:
    """A default group and a sub-group of this instance carry traffic (their keys are this instance's)."""
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    assert t[0].item() == world * (world + 1) / 2, t
    pair = dist.new_group(list(range(world)), timeout=TIMEOUT)
    u = torch.ones(4)
    dist.all_reduce(u, group=pair)
    assert u[0].item() == world, u


def train(rank: int, world: int, out: Path) -> list:
    """Data-parallel SGD, the ChainerMN way: the gradients' mean over the ranks (mean_coalesced), not
    DDP, whose first construction alone takes seconds of imports."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(16, 4, generator=generator)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        torch_chainermn.mean_coalesced([p.grad for p in model.parameters()])
        optimizer.step()
        losses.append(loss.item())
    # The replicas stayed equal: every rank's weights sum to world times its own.
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    total = weights.clone()
    dist.all_reduce(total)
    assert torch.allclose(total, weights * world), (total, weights)
    if rank == 0:
        torch.save(model.state_dict(), out / "checkpoint.pt")
    return losses


def main() -> None:
    out = Path(sys.argv[1])
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group("chainermn", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(REINITS):
        check_groups_once(rank, world)
        dist.destroy_process_group()
        dist.init_process_group("chainermn", timeout=TIMEOUT)
    check_groups_once(rank, world)

    marker = out / "rank1-died"
    if rank == 1 and not marker.exists():
        marker.touch()
        os._exit(3)  # mid-job, with the groups' shared memory and Gloo pairs in use
    dist.barrier()  # the survivor of a failed attempt fails here, and the launcher restarts it

    losses = train(rank, world, out)
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"world": world, "restart": restart, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
