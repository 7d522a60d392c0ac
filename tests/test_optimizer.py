"""create_multi_node_optimizer: ChainerMN's broadcast-then-mean update, and its double buffering."""

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from tests.support.harness import run_mpiexec, run_spawn
from tests.support.training_reference import LR, loss_of, make_model, max_difference, parameters_of, sgd_reference

STEPS = 5


def train(steps=STEPS, **options):
    """Ranks start from different weights; returns the parameters after every call of step()."""
    rank = dist.get_rank()
    model = make_model(seed=rank)
    optimizer = torch_chainermn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=LR), **options)
    after_each_step = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.step()
        after_each_step.append(parameters_of(model))
    return after_each_step, optimizer


def first_step_broadcast_then_mean():
    size = dist.get_world_size()
    initial = parameters_of(make_model(seed=0))
    # The first call only broadcasts rank 0's parameters; call k >= 2 applies the mean of its own step.
    synchronous = sgd_reference(size, STEPS, lambda k, means: means[k] if k >= 1 else None)
    # Double buffering: calls 1 and 2 do not update; call k >= 3 applies the mean of call k-1.
    stale = sgd_reference(size, STEPS, lambda k, means: means[k - 1] if k >= 2 else None)
    assert max_difference(synchronous, stale) > 1e-3
    out = {}

    steps, _ = train()
    out["broadcast"] = max_difference(steps[0], initial)
    out["synchronous"] = max_difference(steps[-1], synchronous)

    steps, optimizer = train(double_buffering=True)
    out["double buffering: broadcast"] = max_difference(steps[0], initial)
    out["double buffering: no update at call 2"] = max_difference(steps[1], initial)
    out["double buffering"] = max_difference(steps[-1], stale)
    optimizer.flush()

    half = dist.new_group(backend="chainermn", pg_options=torch_chainermn.Options(allreduce_grad_dtype=torch.float16))
    steps, _ = train(communicator=half)
    out["fp16 on the wire"] = max_difference(steps[-1], synchronous)
    out["fp16 on the wire is not float32"] = float(max_difference(steps[-1], synchronous) > 0)
    steps, _ = train(communicator=half, double_buffering=True)
    out["fp16 + double buffering"] = max_difference(steps[-1], stale)
    return out


def zero_fill_and_new_parameters():
    rank = dist.get_rank()
    a = torch.nn.Parameter(torch.full((3,), float(rank)))
    b = torch.nn.Parameter(torch.full((2,), float(rank)))
    optimizer = torch_chainermn.create_multi_node_optimizer(torch.optim.SGD([a, b], lr=1.0))
    optimizer.step()  # broadcast: a = b = 0 everywhere
    out = {"broadcast": (a.tolist(), b.tolist())}
    a.grad = torch.full((3,), rank + 1.0)
    b.grad = torch.full((2,), 10.0 * (rank + 1)) if rank % 2 == 0 else None
    optimizer.step()
    out["mean"] = (a.grad.tolist(), b.grad.tolist(), a.tolist(), b.tolist())

    # zero_fill=False: a parameter without a gradient on every rank is left alone.
    c = torch.nn.Parameter(torch.ones(2))
    skipping = torch_chainermn.create_multi_node_optimizer(torch.optim.SGD([a, c], lr=1.0), zero_fill=False)
    skipping.step()
    a.grad = torch.full((3,), rank + 1.0)
    skipping.step()
    out["skipped"] = (c.grad, c.tolist())

    # A new parameter group: the next step broadcasts again instead of updating.
    d = torch.nn.Parameter(torch.full((4,), 5.0 + rank))
    optimizer.add_param_group({"params": [d]})
    a.grad = torch.full((3,), rank + 1.0)
    before = a.detach().clone()
    optimizer.step()
    out["rebroadcast"] = (d.tolist(), torch.equal(a.detach(), before))
    return out


def optimizer_protocol():
    """What LR schedulers and checkpoints rely on: it is an Optimizer sharing the wrapped one's state."""
    model = make_model()
    actual = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    optimizer = torch_chainermn.create_multi_node_optimizer(actual)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(3):
        optimizer.zero_grad()
        loss_of(model, dist.get_rank(), step).backward()
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict()
    restored = torch.optim.SGD(make_model().parameters(), lr=LR, momentum=0.9)
    restored.load_state_dict(saved)
    errors = []
    gloo = dist.new_group(backend="gloo")
    for call in (
        lambda: torch_chainermn.create_multi_node_optimizer(object()),
        lambda: torch_chainermn.create_multi_node_optimizer(actual, communicator=gloo),
        lambda: torch_chainermn.create_multi_node_optimizer(actual, communicator="world"),
    ):
        try:
            call()
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    return {
        "is optimizer": isinstance(optimizer, torch.optim.Optimizer),
        "lr": (optimizer.param_groups[0]["lr"], actual.param_groups[0]["lr"]),
        "momentum buffers": sum("momentum_buffer" in s for s in restored.state.values()),
        "parameters": len(list(model.parameters())),
        "errors": errors,
    }


def check_training(outcomes):
    for out in outcomes:
        for name, difference in out.items():
            if name == "fp16 on the wire is not float32":
                assert difference == 1.0
            else:
                assert difference <= (5e-4 if "fp16" in name else 1e-5), (name, difference)


def check_zero_fill(outcomes):
    size = len(outcomes)
    even = [r for r in range(size) if r % 2 == 0]
    mean_a = sum(r + 1.0 for r in range(size)) / size
    mean_b = sum(10.0 * (r + 1) for r in even) / size  # odd ranks count as zeros
    for out in outcomes:
        assert out["broadcast"] == ([0.0] * 3, [0.0] * 2)
        a_grad, b_grad, a, b = out["mean"]
        assert a_grad == pytest.approx([mean_a] * 3) and b_grad == pytest.approx([mean_b] * 2)
        assert a == pytest.approx([-mean_a] * 3) and b == pytest.approx([-mean_b] * 2)
        c_grad, c = out["skipped"]
        assert c_grad is None and c == [1.0, 1.0]
        d, a_unchanged = out["rebroadcast"]
        assert d == [5.0] * 4 and a_unchanged


def all_cases():
    return first_step_broadcast_then_mean(), zero_fill_and_new_parameters()


@pytest.mark.parametrize("size", [2, 4])
def test_multi_node_optimizer(size):
    env = {"CHAINERMN_RANKS_PER_NODE": "2"} if size == 4 else None
    training, zero_fill = zip(*run_spawn(all_cases, size, env=env, timeout=300))
    check_training(training)
    check_zero_fill(zero_fill)


@pytest.mark.mpi
def test_multi_node_optimizer_over_mpi():
    check_training(run_mpiexec(first_step_broadcast_then_mean, 2))


def test_optimizer_protocol():
    for out in run_spawn(optimizer_protocol, 2):
        assert out["is optimizer"]
        assert out["lr"] == (LR / 8, LR / 8)
        assert out["momentum buffers"] == out["parameters"]
        assert "must be a torch.optim.Optimizer" in out["errors"][0]
        assert "chainermn backend" in out["errors"][1]
        assert "comm must be" in out["errors"][2]
