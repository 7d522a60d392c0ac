"""DDP on the chainermn backend trains the same model as DDP on torch's gloo backend."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.harness import run_mpiexec, run_spawn


class Net(nn.Module):
    """Conv + BatchNorm (buffers to broadcast), and optionally a branch that is never used."""

    def __init__(self, with_unused_branch=False):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, 5)
        if with_unused_branch:
            self.unused = nn.Linear(3, 3)  # needs find_unused_parameters=True

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def train(process_group, seed_by_rank: bool, steps: int = 6, **ddp_kwargs):
    rank = dist.get_rank()
    # Different initial weights on every rank: DDP must broadcast rank 0's at construction.
    torch.manual_seed(1234 + (rank if seed_by_rank else 0))
    model = DDP(Net(ddp_kwargs.get("find_unused_parameters", False)), process_group=process_group, **ddp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(99 + rank)  # each rank its own batches
    for _ in range(steps):
        x = torch.randn(8, 1, 6, 6, generator=data)
        y = torch.randint(0, 5, (8,), generator=data)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    state = model.module.state_dict()
    return {k: v.clone() for k, v in state.items()}


def ddp_against_gloo(**ddp_kwargs):
    gloo = dist.new_group(backend="gloo")
    ours = train(None, seed_by_rank=True, **ddp_kwargs)
    reference = train(gloo, seed_by_rank=True, **ddp_kwargs)
    mismatched = [k for k in ours if not torch.allclose(ours[k].double(), reference[k].double(), rtol=1e-5, atol=1e-6)]
    # Every rank holds the same parameters at the end (BatchNorm's running statistics are updated
    # locally by each forward after DDP broadcasts them, so they differ per rank, as with gloo).
    parameter_names = [name for name, _ in Net(ddp_kwargs.get("find_unused_parameters", False)).named_parameters()]
    flat = torch.cat([ours[name].double().flatten() for name in parameter_names])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    replicas_agree = all(torch.equal(g, gathered[0]) for g in gathered)
    moved = not torch.allclose(
        ours["head.weight"], train(None, seed_by_rank=False, steps=0, **ddp_kwargs)["head.weight"]
    )
    return mismatched, replicas_agree, moved


def check(outcomes):
    for mismatched, replicas_agree, moved in outcomes:
        assert mismatched == [], f"parameters differ from gloo DDP: {mismatched}"
        assert replicas_agree
        assert moved, "training did not change the model"


OPTIONS = {
    "default": {},
    "unused_parameters": {"find_unused_parameters": True},
    "small_buckets": {"bucket_cap_mb": 0.0005, "broadcast_buffers": True},
    "bucket_views": {"gradient_as_bucket_view": True, "find_unused_parameters": True},
}


@pytest.mark.parametrize("options", list(OPTIONS))
def test_ddp_matches_gloo_over_gloo_transport(options):
    check(run_spawn(ddp_against_gloo, 3, **OPTIONS[options]))


@pytest.mark.mpi
@pytest.mark.parametrize("options", ["default", "unused_parameters"])
def test_ddp_matches_gloo_over_mpi_transport(options):
    check(run_mpiexec(ddp_against_gloo, 2, **OPTIONS[options]))
