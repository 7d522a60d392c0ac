"""OverlapNextForward: DDP whose exchange runs on into the next forward gives DDP's parameters bit for bit
(AdamW and SGD with momentum, several buckets, a checkpoint between steps, an unused parameter, a module
used twice), and a lost peer fails the next forward's wait naming the rank."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_chainermn
from tests.support.collective_cases import value_errors
from tests.support.harness import run_spawn
from torch_chainermn import hooks


class Net(torch.nn.Module):
    """Three layers, one of them applied twice, and a layer no rank uses."""

    def __init__(self, unused=True):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(16, 32)
        self.twice = torch.nn.Linear(32, 32)
        self.last = torch.nn.Linear(32, 4)
        if unused:
            self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.last(torch.tanh(self.twice(torch.tanh(self.twice(torch.tanh(self.first(x)))))))


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)


def ddp_of(net):
    # Tiny buckets: every layer's parameters in buckets of their own, exchanged while others compute.
    return DDP(net, bucket_cap_mb=0.001, find_unused_parameters=True)


def train(ddp, optimizer, steps):
    """The usual loop, a learning rate that changes every step included (set before the forward, as a
    schedule does): the overlap must apply each step's update with that step's rate."""
    base = BASE_LR[type(optimizer) if not isinstance(optimizer, torch_chainermn.OverlapNextForward)
                   else type(optimizer.optimizers[0])]
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = base * (1 + step % 3)
        optimizer.zero_grad()
        x, y = batch(dist.get_rank(), step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    if isinstance(optimizer, torch_chainermn.OverlapNextForward):
        optimizer.finish()
    return [p.detach().clone() for p in ddp.module.parameters()]


BASE_LR = {torch.optim.AdamW: 1e-2, torch.optim.SGD: 0.1}


def plain(optimizer_class, steps, **kwargs):
    ddp = ddp_of(Net())
    return train(ddp, optimizer_class(ddp.parameters(), **kwargs), steps)


def overlapped(ddp, overlap, steps):
    return train(ddp, overlap, steps)


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def overlap_cases():
    outcome = {}
    for name, optimizer_class, kwargs in (("adamw", torch.optim.AdamW, {"lr": 1e-2}),
                                          ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        expected = plain(optimizer_class, range(10), **kwargs)
        ddp = ddp_of(Net())
        overlap = torch_chainermn.OverlapNextForward(ddp, optimizer_class, **kwargs)
        outcome[name] = equal(overlapped(ddp, overlap, range(10)), expected)
        outcome[f"{name} moved"] = not equal(expected, [p.detach() for p in Net().parameters()])

    # A checkpoint after 5 steps, loaded into a fresh model and overlap, continues bit for bit.
    expected = plain(torch.optim.AdamW, range(8), lr=1e-2)
    ddp = ddp_of(Net())
    overlap = torch_chainermn.OverlapNextForward(ddp, torch.optim.AdamW, lr=1e-2)
    overlapped(ddp, overlap, range(5))
    model_state, optimizer_state = ddp.state_dict(), overlap.state_dict()
    fresh = ddp_of(Net())
    resumed = torch_chainermn.OverlapNextForward(fresh, torch.optim.AdamW, lr=1e-2)
    fresh.load_state_dict(model_state)
    resumed.load_state_dict(optimizer_state)
    outcome["resumed"] = equal(overlapped(fresh, resumed, range(5, 8)), expected)
    outcome["unused untouched"] = equal([fresh.module.unused.weight.detach()], [Net().unused.weight.detach()])

    # With int8 between nodes: not DDP's bits, but every replica the same, and trained.
    ddp = ddp_of(Net())
    compressed = torch_chainermn.OverlapNextForward(
        ddp, torch.optim.AdamW, compression=hooks.GradientCompressionState(type="int8", block=64), lr=1e-2)
    mine = torch.cat([p.reshape(-1) for p in train(ddp, compressed, range(5))])
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    outcome["int8 replicas equal"] = all(torch.equal(everyone[0], other) for other in everyone)
    outcome["int8 moved"] = not torch.equal(mine, torch.cat([p.detach().reshape(-1) for p in Net().parameters()]))

    outcome["errors"] = value_errors((
        lambda: torch_chainermn.OverlapNextForward(ddp_of(Net()), torch.optim.AdamW, compression="int8"),
        lambda: torch_chainermn.OverlapNextForward(Net(), torch.optim.AdamW),
        lambda: torch_chainermn.OverlapNextForward(ddp_of(Net()), "adamw")))
    return outcome


def test_overlap_gives_ddps_parameters_bit_for_bit():
    for outcome in run_spawn(overlap_cases, 2, env={"CHAINERMN_RANKS_PER_NODE": "1"}, timeout=240):
        assert outcome["adamw"] and outcome["sgd"], outcome
        assert outcome["adamw moved"] and outcome["sgd moved"], outcome
        assert outcome["resumed"] and outcome["unused untouched"], outcome
        assert outcome["int8 replicas equal"] and outcome["int8 moved"], outcome
        not_compression, not_ddp, not_optimizer = outcome["errors"]
        assert "OverlapNextForward: compression must be None or a hooks.GradientCompressionState" in not_compression
        assert "OverlapNextForward: ddp must be a torch.nn.parallel.DistributedDataParallel" in not_ddp
        assert "OverlapNextForward: optimizer_class must be a torch.optim.Optimizer class" in not_optimizer


def peer_dies_during_the_exchange():
    """Rank 0's backward returns with its exchange in the background; then rank 1 dies (never joining
    it), and rank 0's next forward waits for a mean that cannot come."""
    # Without find_unused_parameters: DDP's own end of backward would otherwise wait for rank 1.
    ddp = DDP(Net(unused=False), bucket_cap_mb=0.001)
    overlap = torch_chainermn.OverlapNextForward(ddp, torch.optim.SGD, lr=0.1)
    x, y = batch(dist.get_rank(), 0)
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if dist.get_rank() == 1:
        store.wait(["rank 0's exchange in flight"])
        os._exit(0)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    store.set("rank 0's exchange in flight", "1")
    try:
        ddp(x)
        overlap.finish()
        return "completed"
    except dist.DistBackendError as error:
        return str(error)


def test_a_dead_peer_fails_the_next_forward_naming_it():
    said, _ = run_spawn(peer_dies_during_the_exchange, 2, may_exit=(1,), timeout=120, op_timeout=60)
    assert "rank 1" in said and ("died" in said or "exited" in said), said
