"""A small deterministic training problem and its data-parallel results computed by hand.

Every rank can rebuild every other rank's batch, so the parameters that synchronous, one-step-stale
(double-buffered) or ChainerMN-optimizer training must reach are computed locally, in one process,
with plain SGD, and compared with what the distributed run produced.
"""

from __future__ import annotations

import torch
from torch import nn

LR = 0.1


def make_model(seed: int = 0) -> nn.Module:
    """Big enough that DDP splits it into several buckets with a small bucket_cap_mb."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 600), nn.Tanh(), nn.Linear(600, 500), nn.Tanh(), nn.Linear(500, 4)
    )


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=generator), torch.randn(4, 4, generator=generator)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return nn.functional.mse_loss(model(x), y)


def parameters_of(model: nn.Module) -> list:
    return [p.detach().clone() for p in model.parameters()]


def mean_gradient(params: list, size: int, step: int) -> list:
    """mean over ranks r of the gradient of rank r's loss at step `step`, at `params`."""
    model = make_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    total = [torch.zeros_like(p) for p in params]
    for rank in range(size):
        model.zero_grad()
        loss_of(model, rank, step).backward()
        for t, p in zip(total, model.parameters()):
            t += p.grad
    return [t / size for t in total]


def sgd_reference(size: int, steps: int, applied_at) -> list:
    """Parameters after `steps` SGD steps; applied_at(k, means) picks the gradient step k applies.

    means[j] is the mean gradient computed at step j (at that step's parameters); None = no update.
    """
    params = parameters_of(make_model())
    means = []
    for k in range(steps):
        means.append(mean_gradient(params, size, k))
        gradient = applied_at(k, means)
        if gradient is not None:
            params = [p - LR * g for p, g in zip(params, gradient)]
    return params


def synchronous(size: int, steps: int) -> list:
    return sgd_reference(size, steps, lambda k, means: means[k])


def one_step_stale(size: int, steps: int) -> list:
    """Double-buffered DDP: step 1 applies zeros, step k applies the mean of step k-1."""
    return sgd_reference(size, steps, lambda k, means: means[k - 1] if k >= 1 else None)


def max_difference(a: list, b: list) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))
