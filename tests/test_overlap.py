"""OverlapNextForward: DDP whose exchange runs on into the next forward gives DDP's parameters bit for bit
(AdamW and SGD with momentum, several buckets, a checkpoint between steps, an unused parameter, a module
used twice) on 3 ranks, on one node and on two; the step's last bucket travels on the priority lane; int8
between nodes stays near float32; and a lost peer fails the next forward's wait naming the rank."""

import os

import pytest
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
    base = BASE_LR[
        type(optimizer)
        if not isinstance(optimizer, torch_chainermn.OverlapNextForward)
        else type(optimizer.optimizers[0])
    ]
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


def order_shows(world_size: int) -> bool:
    """Whether, at this world size, DDP's arithmetic on the ranks' first-step gradients (each times
    1/world size, then summed: torch's reducer) gives other bits than dividing each and summing, and
    than summing and dividing once: the bit-equality below can only tell them apart where they differ
    (at 2 ranks all three are exact)."""
    grads = []
    for rank in range(world_size):
        net = Net()
        x, y = batch(rank, 0)
        torch.nn.functional.mse_loss(net(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None]))
    ddps = torch.stack([g * (1.0 / world_size) for g in grads]).sum(0)
    divided_then_summed = torch.stack([g / world_size for g in grads]).sum(0)
    summed_then_divided = torch.stack(grads).sum(0) / world_size
    return not torch.equal(ddps, divided_then_summed) and not torch.equal(ddps, summed_then_divided)


def lanes_of(ddp, overlap, steps):
    """Train `steps` steps and say, step by step, what the priority lane (the overlap's second group) did:
    whether it had carried nothing of the step yet when the gradient of the first layer's output
    arrived (just before the first layer's own gradients, which make the step's last bucket), and how
    many ops it had carried by the end of the step's backward."""
    from torch_chainermn import _backend

    urgent = _backend.backend_of(overlap._urgent_group)
    at_first_layer = []

    def watch_the_output(module, args, out):  # its gradient comes just before the layer's own
        out.register_hook(lambda grad: at_first_layer.append(urgent._get_sequence_number_for_group()))

    ddp.module.first.register_forward_hook(watch_the_output)
    lanes = []
    for step in steps:
        before = urgent._get_sequence_number_for_group()
        x, y = batch(dist.get_rank(), step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()  # the forward applies the step before's update
        lanes.append((at_first_layer[-1] == before, urgent._get_sequence_number_for_group() - before))
        overlap.step()
    overlap.finish()
    return lanes


def overlap_cases(between_nodes: bool):
    outcome = {"order shows": order_shows(dist.get_world_size())}
    expected = {}
    for name, optimizer_class, kwargs in (
        ("adamw", torch.optim.AdamW, {"lr": 1e-2}),
        ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ):
        # The reference: torch's DDP, whose reducer scales every gradient by 1/world size, then sums.
        expected[name] = plain(optimizer_class, range(10), **kwargs)
        ddp = ddp_of(Net())
        overlap = torch_chainermn.OverlapNextForward(ddp, optimizer_class, **kwargs)
        outcome[name] = equal(overlapped(ddp, overlap, range(10)), expected[name])
        outcome[f"{name} moved"] = not equal(expected[name], [p.detach() for p in Net().parameters()])

    # The priority lane carries the step's last bucket (the first layers), one op a step.
    ddp = ddp_of(Net())
    overlap = torch_chainermn.OverlapNextForward(ddp, torch.optim.SGD, lr=0.1)
    outcome["lanes"] = lanes_of(ddp, overlap, range(3))
    if not between_nodes:
        return outcome

    # A checkpoint after 5 steps, loaded into a fresh model and overlap, continues bit for bit.
    resumed_expected = plain(torch.optim.AdamW, range(8), lr=1e-2)
    ddp = ddp_of(Net())
    overlap = torch_chainermn.OverlapNextForward(ddp, torch.optim.AdamW, lr=1e-2)
    overlapped(ddp, overlap, range(5))
    model_state, optimizer_state = ddp.state_dict(), overlap.state_dict()
    fresh = ddp_of(Net())
    resumed = torch_chainermn.OverlapNextForward(fresh, torch.optim.AdamW, lr=1e-2)
    fresh.load_state_dict(model_state)
    resumed.load_state_dict(optimizer_state)
    outcome["resumed"] = equal(overlapped(fresh, resumed, range(5, 8)), resumed_expected)
    outcome["unused untouched"] = equal([fresh.module.unused.weight.detach()], [Net().unused.weight.detach()])

    # With int8 between nodes: not DDP's bits, but every replica the same, and near float32's training.
    # SGD, whose step is proportional to the gradient: a mean off by a factor shows (AdamW's would not).
    ddp = ddp_of(Net())
    compressed = torch_chainermn.OverlapNextForward(
        ddp, torch.optim.SGD, compression=hooks.GradientCompressionState(code="int8", block=64), lr=0.1, momentum=0.9
    )
    mine = torch.cat([p.reshape(-1) for p in train(ddp, compressed, range(10))])
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    outcome["int8 replicas equal"] = all(torch.equal(everyone[0], other) for other in everyone)
    float32 = torch.cat([p.reshape(-1) for p in expected["sgd"]])
    start = torch.cat([p.detach().reshape(-1) for p in Net().parameters()])
    # How far int8's parameters are from float32's, against how far float32's moved.
    outcome["int8 off float32"] = ((mine - float32).norm() / (float32 - start).norm()).item()

    outcome["errors"] = value_errors(
        (
            lambda: torch_chainermn.OverlapNextForward(ddp_of(Net()), torch.optim.AdamW, compression="int8"),
            lambda: torch_chainermn.OverlapNextForward(Net(), torch.optim.AdamW),
            lambda: torch_chainermn.OverlapNextForward(ddp_of(Net()), "adamw"),
        )
    )
    return outcome


# int8 (block 64, error feedback) ends 0.2% of float32's distance travelled away from it after 10 SGD steps
# (0.0018 measured on 3 ranks, 2 nodes); a mean off by a factor or a lost residual goes far past 2%.
INT8_OFF_FLOAT32 = 0.02

# 3 ranks (at 2 the order of division and summation cannot show): one node over shared memory, and two
# nodes (2 + 1 ranks) where int8 compresses between them.
OVERLAP_CONFIGS = {
    "one-node-shared-memory": ({"CHAINERMN_SHM": "1"}, False),
    "two-nodes": ({"CHAINERMN_RANKS_PER_NODE": "2"}, True),
}


@pytest.mark.parametrize("config", list(OVERLAP_CONFIGS))
def test_overlap_gives_ddps_parameters_bit_for_bit(config):
    env, between_nodes = OVERLAP_CONFIGS[config]
    for outcome in run_spawn(overlap_cases, 3, between_nodes, env=env, timeout=240):
        assert outcome["order shows"], outcome
        assert outcome["adamw"] and outcome["sgd"], outcome
        assert outcome["adamw moved"] and outcome["sgd moved"], outcome
        # Every step: nothing on the priority lane before the first layer's gradients, one op by the end.
        assert outcome["lanes"] == [(True, 1)] * 3, outcome["lanes"]
        if not between_nodes:
            continue
        assert outcome["resumed"] and outcome["unused untouched"], outcome
        assert outcome["int8 replicas equal"], outcome
        assert outcome["int8 off float32"] < INT8_OFF_FLOAT32, outcome
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
    said, _ = run_spawn(peer_dies_during_the_exchange, 2, dies={1: "exit code 0"}, timeout=120, op_timeout=60)
    assert "rank 1" in said and ("died" in said or "exited" in said), said
