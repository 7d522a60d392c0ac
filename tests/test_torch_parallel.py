"""torch's own parallelism on a chainermn group gives what it gives on gloo: FSDP2 (`fully_shard`),
ZeroRedundancyOptimizer under DDP, and distributed checkpointing (save, then load into a fresh model).

One 2-rank job trains the same model the same way on a chainermn group and on a gloo group (same
processes, same data) and returns both results, so each test compares them. The functions take the
device the model lives on: tests/test_cuda_torch_parallel.py runs them on CUDA against nccl.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_spawn

STEPS = 3


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 12, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(STEPS)]


def train(model, optimizer, rank, device="cpu"):
    for x, y in batches(rank):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        optimizer.step()


def fsdp2(group, rank, device="cpu"):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DeviceMesh

    mesh = DeviceMesh.from_group(group, torch.device(device).type)
    model = make_model().to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, device)
    return [p.full_tensor().detach().cpu().clone() for p in model.parameters()]


def zero(group, rank, device="cpu"):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    device_ids = [torch.cuda.current_device()] if torch.device(device).type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(
        make_model().to(device), process_group=group, device_ids=device_ids
    )
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01, process_group=group
    )
    train(model, optimizer, rank, device)
    return [p.detach().cpu().clone() for p in model.parameters()]


def checkpoint(group, rank, directory, device="cpu"):
    import torch.distributed.checkpoint as dcp

    trained = make_model().to(device)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.5)
    dcp.save({"model": trained.state_dict()}, checkpoint_id=directory, process_group=group)
    fresh = make_model().to(device)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=directory, process_group=group)
    fresh.load_state_dict(state["model"])
    return all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), trained.state_dict().values()))


def both_backends(directory):
    rank = dist.get_rank()
    results = {}
    for backend in ("chainermn", "gloo"):
        group = dist.new_group([0, 1], backend=backend)
        results[backend] = {
            "fsdp2": fsdp2(group, rank),
            "zero": zero(group, rank),
            "checkpoint": checkpoint(group, rank, f"{directory}/{backend}"),
        }
    return results


_outcomes = []


def outcomes():
    if not _outcomes:
        with tempfile.TemporaryDirectory(prefix="chainermn-dcp-") as directory:
            _outcomes.append(run_spawn(both_backends, 2, directory, timeout=240))
    return _outcomes[0]


@pytest.mark.parametrize("what", ["fsdp2", "zero"])
def test_training_matches_gloo(what):
    for rank, result in enumerate(outcomes()):
        ours, theirs = result["chainermn"][what], result["gloo"][what]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{what} on rank {rank}")
        start = [p.detach() for p in make_model().parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(ours, start)), f"{what} did not train"


def test_distributed_checkpoint_saves_and_loads():
    for result in outcomes():
        assert result["chainermn"]["checkpoint"] is True
        assert result["gloo"]["checkpoint"] is True
