"""MultiNodeBatchNorm{1,2,3}d equal nn.BatchNorm run on the global batch, on real processes.

Every rank builds every rank's input from deterministic seeds, so it can compute the single-process
reference (nn.BatchNorm on the concatenated global batch) locally and compare its own slice.
All checks of one launch run in one function: each launch costs seconds.
"""

import copy
import datetime
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_chainermn.nn as mnnn
from tests.support.harness import run_spawn

DTYPE = torch.float64
BATCH_NORMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
MULTI_NODE = {1: mnnn.MultiNodeBatchNorm1d, 2: mnnn.MultiNodeBatchNorm2d, 3: mnnn.MultiNodeBatchNorm3d}
SPATIAL = {1: (5,), 2: (3, 4), 3: (2, 3, 2)}
CHANNELS = 3


class Communicator:
    """Stands in for a torch_chainermn communicator: anything with a `group` attribute."""

    def __init__(self, group):
        self.group = group


def batch(seed: int, rows: int, spatial, dtype=DTYPE):
    """Input and output gradient of one rank, reproducible on every rank; a large mean on purpose."""
    generator = torch.Generator().manual_seed(seed)
    shape = (rows, CHANNELS, *spatial)
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 2.5 + 4.0
    grad_y = torch.randn(shape, generator=generator, dtype=torch.float64)
    return x.to(dtype), grad_y.to(dtype)


def initialise(layer, seed: int):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(CHANNELS, generator=generator, dtype=torch.float64) + 0.5)
        layer.bias.copy_(torch.randn(CHANNELS, generator=generator, dtype=torch.float64))


def compare_with_global_batch(dim: int, sizes, comm, spatial=None, dtype=DTYPE, momentum=0.1, steps=2, tolerance=1e-10):
    """Run MNBN on this rank's batch and nn.BatchNorm on the global batch for `steps` steps; compare."""
    rank, size = dist.get_rank(), dist.get_world_size()
    spatial = SPATIAL[dim] if spatial is None else spatial
    reference = BATCH_NORMS[dim](CHANNELS, momentum=momentum, dtype=dtype)
    layer = MULTI_NODE[dim](CHANNELS, comm, momentum=momentum, dtype=dtype)
    initialise(reference, 7)
    initialise(layer, 7)
    differs_from_local_batch_norm = False
    for step in range(steps):
        inputs = [batch(1000 * step + r, sizes[r], spatial, dtype) for r in range(size)]
        x = inputs[rank][0].clone().requires_grad_()
        y = layer(x)
        y.backward(inputs[rank][1])

        global_x = torch.cat([i[0] for i in inputs]).requires_grad_()
        global_y = reference(global_x)
        global_y.backward(torch.cat([i[1] for i in inputs]))
        start = sum(sizes[:rank])
        mine = slice(start, start + sizes[rank])
        close = dict(rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(y, global_y[mine], **close)
        torch.testing.assert_close(x.grad, global_x.grad[mine], **close)
        # Weight/bias gradients are each rank's share; their sum (what the optimizer's gradient
        # allreduce forms) is the global batch's gradient.
        summed = torch.stack([layer.weight.grad, layer.bias.grad])
        dist.all_reduce(summed)
        torch.testing.assert_close(summed[0], reference.weight.grad, **close)
        torch.testing.assert_close(summed[1], reference.bias.grad, **close)
        torch.testing.assert_close(layer.running_mean, reference.running_mean, **close)
        torch.testing.assert_close(layer.running_var, reference.running_var, **close)
        assert layer.num_batches_tracked.item() == reference.num_batches_tracked.item() == step + 1

        # Plain BatchNorm on the local batch gives something else: the comparison has teeth.
        if sizes[rank] > 0:
            local = BATCH_NORMS[dim](CHANNELS, momentum=momentum, dtype=dtype)
            initialise(local, 7)
            local_x = inputs[rank][0].clone().requires_grad_()
            local(local_x).backward(inputs[rank][1])
            differs_from_local_batch_norm |= not torch.allclose(local(inputs[rank][0]), y.detach(), atol=1e-6)
            differs_from_local_batch_norm |= not torch.allclose(local_x.grad, x.grad, atol=1e-6)
        layer.zero_grad()
        reference.zero_grad()
    # Where this rank's batch is empty, or is the whole global batch, there is no difference to see.
    return differs_from_local_batch_norm or sizes[rank] in (0, sum(sizes))


def batch_norm_cases():
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {}
    default = None
    group = dist.new_group(list(range(size)))
    communicator = Communicator(group)
    equal = [4] * size
    unequal = [2 + 3 * r for r in range(size)]
    results["equal-1d"] = compare_with_global_batch(1, equal, default)
    results["unequal-1d"] = compare_with_global_batch(1, unequal, group)
    results["unequal-1d-2D-input"] = compare_with_global_batch(1, unequal, communicator, spatial=())
    results["equal-2d"] = compare_with_global_batch(2, equal, communicator)
    results["unequal-2d"] = compare_with_global_batch(2, unequal, default)
    results["equal-3d"] = compare_with_global_batch(3, equal, group)
    results["unequal-3d"] = compare_with_global_batch(3, unequal, communicator)
    # A rank with an empty batch still takes part; momentum=None is the cumulative average.
    results["empty-rank-2d"] = compare_with_global_batch(2, [0] + unequal[1:], default, momentum=None, steps=3)
    # float32: the sums travel in float64, so even a large mean costs no visible precision.
    results["float32-2d"] = compare_with_global_batch(2, unequal, default, dtype=torch.float32, tolerance=2e-5)
    assert all(results.values()), results

    check_special_modes(rank, size)
    check_conversion_copy_and_state_dict(rank, size, group)
    check_errors(rank, size)
    return sorted(results)


def check_special_modes(rank, size):
    """Eval mode and track_running_stats=False: like BatchNorm, and eval mode never communicates."""
    x, grad_y = batch(50 + rank, 3, SPATIAL[2])
    layer = mnnn.MultiNodeBatchNorm2d(CHANNELS, dtype=DTYPE)
    reference = nn.BatchNorm2d(CHANNELS, dtype=DTYPE)
    initialise(layer, 3)
    initialise(reference, 3)
    with torch.no_grad():
        for module in (layer, reference):
            module.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
            module.running_var.copy_(torch.tensor([1.5, 0.25, 4.0]))
    layer.eval()
    reference.eval()
    # Only rank 0 runs these, on a group with a short timeout: any collective would fail the test.
    lonely = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=5))
    no_stats = mnnn.MultiNodeBatchNorm2d(CHANNELS, lonely, track_running_stats=False, dtype=DTYPE).eval()
    if rank == 0:
        layer.comm = lonely
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-12, atol=1e-12)
        # Eval mode without running statistics: the local batch's statistics, as in SyncBatchNorm.
        torch.testing.assert_close(no_stats(x), nn.functional.batch_norm(x, None, None, training=True))
        assert no_stats.running_mean is None and no_stats.num_batches_tracked is None
    dist.barrier()

    # Training without running statistics: global batch statistics, nothing tracked.
    inputs = [batch(60 + r, 2 + r, SPATIAL[2]) for r in range(size)]
    untracked = mnnn.MultiNodeBatchNorm2d(CHANNELS, None, track_running_stats=False, affine=False, dtype=DTYPE)
    x = inputs[rank][0].clone().requires_grad_()
    y = untracked(x)
    y.backward(inputs[rank][1])
    global_x = torch.cat([i[0] for i in inputs]).requires_grad_()
    global_y = nn.functional.batch_norm(global_x, None, None, training=True)
    global_y.backward(torch.cat([i[1] for i in inputs]))
    mine = slice(sum(2 + r for r in range(rank)), sum(2 + r for r in range(rank + 1)))
    torch.testing.assert_close(y, global_y[mine])
    torch.testing.assert_close(x.grad, global_x.grad[mine])

    # An input that needs no gradient: weight and bias still get theirs, on every rank alike.
    layer.train()
    layer.comm = None
    layer.zero_grad()
    layer(inputs[rank][0]).backward(inputs[rank][1])
    assert layer.weight.grad is not None and layer.bias.grad is not None


def check_conversion_copy_and_state_dict(rank, size, group):
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(
        nn.Conv2d(2, CHANNELS, 1),
        nn.BatchNorm2d(CHANNELS),
        nn.ReLU(),
        nn.Sequential(nn.Flatten(), nn.Linear(CHANNELS * 4, 4), nn.BatchNorm1d(4, momentum=None)),
        nn.BatchNorm3d(2, eps=1e-3, affine=False),
    ).double()
    model[3][2].weight.requires_grad_(False)
    model[4].eval()
    with torch.no_grad():
        model[1].running_mean.fill_(0.25)
        model[1].num_batches_tracked.fill_(9)
    old_parameters = {name: p for name, p in model.named_parameters()}
    old_buffers = {name: b for name, b in model.named_buffers()}
    expected_state = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model)  # plain BatchNorm, for the global batch

    converted = mnnn.convert_mnbn_model(model, group)
    assert type(converted[1]) is mnnn.MultiNodeBatchNorm2d
    assert type(converted[3][2]) is mnnn.MultiNodeBatchNorm1d
    assert type(converted[4]) is mnnn.MultiNodeBatchNorm3d
    assert converted[1].comm is group and converted[3][2].momentum is None
    assert converted[4].eps == 1e-3 and not converted[4].affine and converted[4].weight is None
    assert converted[4].training is False and converted[1].training is True
    assert not converted[3][2].weight.requires_grad and converted[3][2].bias.requires_grad
    # The very same tensors: an optimizer made before the conversion still works.
    assert all(p is old_parameters[name] for name, p in converted.named_parameters())
    assert all(b is old_buffers[name] for name, b in converted.named_buffers())
    assert converted.state_dict().keys() == expected_state.keys()
    assert mnnn.create_mnbn_model is mnnn.convert_mnbn_model
    single = mnnn.convert_mnbn_model(nn.BatchNorm2d(5), group)  # a BatchNorm itself is replaced
    assert type(single) is mnnn.MultiNodeBatchNorm2d and single.num_features == 5
    if "bias" in inspect.signature(nn.BatchNorm2d).parameters:  # torch >= 2.13: affine without bias
        weight_only = mnnn.convert_mnbn_model(nn.BatchNorm2d(5, bias=False), group)
        assert weight_only.weight is not None and weight_only.bias is None

    # The converted model trains on the global batch: compare with the original run on all of it.
    inputs = [torch.randn(2 + r, 2, 2, 2, generator=torch.Generator().manual_seed(r), dtype=DTYPE) for r in range(size)]
    head = nn.Sequential(*list(converted)[:4])
    out = head(inputs[rank])
    global_out = reference[:4](torch.cat(inputs))
    mine = slice(sum(2 + r for r in range(rank)), sum(2 + r for r in range(rank + 1)))
    torch.testing.assert_close(out, global_out[mine])
    torch.testing.assert_close(converted[3][2].running_var, reference[3][2].running_var)
    torch.testing.assert_close(converted[1].running_mean, reference[1].running_mean)

    # deepcopy: new tensors, the same communicator; the copy computes what the original does.
    layer = converted[1]
    twin = copy.deepcopy(layer)
    assert twin.comm is group and twin.weight is not layer.weight
    assert twin.running_mean.data_ptr() != layer.running_mean.data_ptr()
    x = torch.randn(3, CHANNELS, 2, 2, generator=torch.Generator().manual_seed(rank), dtype=DTYPE)
    torch.testing.assert_close(twin(x), layer(x))
    torch.testing.assert_close(twin.running_mean, layer.running_mean)
    assert copy.copy(layer).comm is group

    # state_dict: loadable into nn.BatchNorm and back, strictly, same keys and values.
    plain = nn.BatchNorm2d(CHANNELS, dtype=DTYPE)
    plain.load_state_dict(layer.state_dict())
    back = mnnn.MultiNodeBatchNorm2d(CHANNELS, group, dtype=DTYPE)
    back.load_state_dict(plain.state_dict())
    for key, value in layer.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value)
        torch.testing.assert_close(back.state_dict()[key], value)
    assert layer.num_batches_tracked.item() == 11  # 9 + the two training forwards above


def check_errors(rank, size):
    layer = mnnn.MultiNodeBatchNorm2d(CHANNELS)
    for bad, words in [
        (lambda: layer(torch.ones(2, CHANNELS, 3)), "MultiNodeBatchNorm2d: expected 4D input"),
        (lambda: layer(torch.ones(2, CHANNELS + 1, 3, 3)), "expected 3 channels"),
        (lambda: mnnn.MultiNodeBatchNorm1d(0), "num_features"),
        (lambda: mnnn.MultiNodeBatchNorm3d(2, momentum=2.0), "momentum"),
        (lambda: mnnn.MultiNodeBatchNorm1d(3, comm="world"), None),
        (lambda: mnnn.convert_mnbn_model("model"), "module must be a torch.nn.Module"),
    ]:
        if words is None:  # a bad comm is noticed when the layer first communicates
            with pytest.raises(ValueError, match="MultiNodeBatchNorm1d: comm must be"):
                bad()(torch.ones(4, 3))
            continue
        with pytest.raises(ValueError, match=words):
            bad()
    # One value per channel in the whole global batch: every rank raises, none is left waiting.
    one_row = torch.ones(1 if rank == 0 else 0, CHANNELS)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        mnnn.MultiNodeBatchNorm1d(CHANNELS)(one_row)
    check = torch.ones(1)
    dist.all_reduce(check)  # the group still works
    assert check.item() == size


def test_multi_node_batch_norm():
    # Three ranks, so that unequal batches, an empty rank and the sums are all non-trivial. The layer
    # only calls dist.all_reduce: the transports are covered by test_collectives.
    assert run_spawn(batch_norm_cases, 3, timeout=240) == [sorted_cases()] * 3


def sorted_cases():
    return sorted(
        [
            "equal-1d",
            "unequal-1d",
            "unequal-1d-2D-input",
            "equal-2d",
            "unequal-2d",
            "equal-3d",
            "unequal-3d",
            "empty-rank-2d",
            "float32-2d",
        ]
    )
