"""Multi-node batch normalization: BatchNorm whose statistics are those of the global batch.

ChainerMN's `MultiNodeBatchNormalization` for PyTorch. Plain `nn.BatchNorm2d` in data-parallel
training normalizes every rank's local batch with that batch's own mean and variance; with small local
batches those statistics are noisy. `MultiNodeBatchNorm2d` allreduces per-channel sums so that every
rank normalizes with the statistics of the global batch (the concatenation of all ranks' batches), and
its backward pass allreduces the two per-channel gradient sums that the input gradient needs. The
result equals `nn.BatchNorm2d` run on the global batch in one process: output, input gradient, running
statistics, and weight/bias gradients (summed over ranks, as the data-parallel gradient allreduce does).

Unlike ChainerMN, which averaged per-rank means, the sums are weighted by each rank's element count,
so ranks may hold batches of different sizes (even empty ones). Unlike torch's `SyncBatchNorm`, it runs
on CPU tensors as well as CUDA ones, and it takes a ChainerMN communicator.

    model = torch_chainermn.convert_mnbn_model(model, comm)   # every BatchNorm{1,2,3}d replaced
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ._backend import group_of

__all__ = [
    "MultiNodeBatchNorm1d",
    "MultiNodeBatchNorm2d",
    "MultiNodeBatchNorm3d",
    "convert_mnbn_model",
    "create_mnbn_model",
]

# The per-channel sums travel in float64: each rank forms them from its own numerically stable mean
# and variance, and E[x^2] - E[x]^2 of the global batch is then computed where the cancellation costs
# nothing visible at the precision of the input. The buffer has only 2C + 1 elements.
_STATISTICS_DTYPE = torch.float64


def _reduced_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channel dimension (1): batch and spatial."""
    return [0] + list(range(2, x.dim()))


def _per_channel(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast against x of shape (N, C, *)."""
    return values.view([1, -1] + [1] * (x.dim() - 2))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # float16/bfloat16 inputs are normalized in float32, as torch's own batch_norm kernels do.
    return torch.promote_types(x.dtype, torch.float32)


class _MultiNodeBatchNormFunction(torch.autograd.Function):
    """Batch normalization over the global batch of `group`, with a hand-written backward.

    Forward: one allreduce of [count, sum(x), sum(x^2)] per channel, packed in one buffer.
    Backward: one allreduce of [sum(gy), sum(gy * x_hat)] per channel, packed in one buffer.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, module_name):
        channels = x.shape[1]
        dims = _reduced_dims(x)
        compute_dtype = _compute_dtype(x)
        x_compute = x.to(compute_dtype)
        local_count = x.numel() // channels if channels else 0

        packed = torch.zeros(2 * channels + 1, dtype=_STATISTICS_DTYPE, device=x.device)
        packed[0] = local_count
        if local_count > 0:
            # var_mean is a two-pass, numerically stable computation of the local statistics.
            local_var, local_mean = torch.var_mean(x_compute, dim=dims, unbiased=False)
            local_mean = local_mean.to(_STATISTICS_DTYPE)
            local_var = local_var.to(_STATISTICS_DTYPE)
            packed[1 : channels + 1] = local_mean * local_count
            packed[channels + 1 :] = (local_var + local_mean * local_mean) * local_count
        dist.all_reduce(packed, group=group)

        global_count = int(packed[0].item())
        if global_count <= 1:
            # Same condition as nn.BatchNorm, on the global batch: every rank sees the same count,
            # so every rank raises and none is left waiting in the next collective.
            raise ValueError(
                f"{module_name}: expected more than 1 value per channel when training, got "
                f"{global_count} across all ranks (local input size {list(x.shape)})"
            )
        mean = packed[1 : channels + 1] / global_count
        var = (packed[channels + 1 :] / global_count - mean * mean).clamp_min_(0)

        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased_var = var * (global_count / (global_count - 1))
            with torch.no_grad():
                running_var.mul_(1 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)

        mean = mean.to(compute_dtype)
        invstd = torch.rsqrt(var.to(compute_dtype) + eps)
        y = (x_compute - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            y = y * _per_channel(weight.to(compute_dtype), x)
        if bias is not None:
            y = y + _per_channel(bias.to(compute_dtype), x)

        # x rather than x_hat is kept: x_hat is cheap to recompute and would double the memory held.
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.group = group
        ctx.global_count = global_count
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = _reduced_dims(x)
        compute_dtype = mean.dtype
        channels = x.shape[1]
        grad_y = grad_output.to(compute_dtype)
        x_hat = (x.to(compute_dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)
        sum_grad_y = grad_y.sum(dims)
        sum_grad_y_x_hat = (grad_y * x_hat).sum(dims)

        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # Every rank's loss depends on this rank's x through the global statistics: the input
            # gradient needs the global sums. Weight and bias act after normalization, so their
            # gradients stay local (the optimizer's gradient allreduce sums them).
            packed = torch.cat([sum_grad_y, sum_grad_y_x_hat]).to(_STATISTICS_DTYPE)
            dist.all_reduce(packed, group=ctx.group)
            mean_grad_y = (packed[:channels] / ctx.global_count).to(compute_dtype)
            mean_grad_y_x_hat = (packed[channels:] / ctx.global_count).to(compute_dtype)
            scale = invstd if weight is None else invstd * weight.to(compute_dtype)
            grad_x = grad_y - _per_channel(mean_grad_y, x) - x_hat * _per_channel(mean_grad_y_x_hat, x)
            grad_x = (grad_x * _per_channel(scale, x)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_grad_y_x_hat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_grad_y.to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


class _Shared:
    """Holds an object that copy.deepcopy must not copy (a communicator or a ProcessGroup).

    A copied model keeps communicating on the same group, as a copied SyncBatchNorm does.
    """

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class _MultiNodeBatchNorm(_BatchNorm):
    """Shared implementation of MultiNodeBatchNorm{1,2,3}d; subclasses only check the input's rank."""

    _input_dims: tuple[int, ...] = ()

    def __init__(
        self,
        num_features: int,
        comm=None,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        **kwargs,
    ):
        name = type(self).__name__
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
            raise ValueError(f"{name}: num_features must be a positive int, got {num_features!r}")
        if not eps > 0:
            raise ValueError(f"{name}: eps must be positive, got {eps!r}")
        if momentum is not None and not 0 <= momentum <= 1:
            raise ValueError(f"{name}: momentum must be None or in [0, 1], got {momentum!r}")
        # kwargs: keyword-only options of the installed torch's BatchNorm (torch 2.13: bias=False).
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **kwargs)
        self._comm = _Shared(comm)

    @property
    def comm(self):
        """The communicator (or ProcessGroup, or None for the default group) statistics are shared on."""
        return self._comm.value

    @comm.setter
    def comm(self, value):
        self._comm = _Shared(value)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in self._input_dims:
            wanted = " or ".join(f"{d}D" for d in self._input_dims)
            raise ValueError(
                f"{type(self).__name__}: expected {wanted} input, got {input.dim()}D input of shape {list(input.shape)}"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}: expected {self.num_features} channels (dimension 1), "
                f"got input of shape {list(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # Momentum and the running-stat bookkeeping follow nn.BatchNorm exactly (momentum=None is a
        # cumulative average), so a state_dict moves between the two unchanged.
        exponential_average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
        uses_batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        keeps_running_stats = not self.training or self.track_running_stats
        running_mean = self.running_mean if keeps_running_stats else None
        running_var = self.running_var if keeps_running_stats else None

        # Only training-mode batch statistics are shared. In eval mode the running statistics (or,
        # without them, the local batch's statistics, as in SyncBatchNorm) need no communication.
        group = None
        if uses_batch_statistics and self.training:
            group = group_of(self.comm, type(self).__name__)
            if dist.get_world_size(group) == 1:
                group = None
        if group is None:
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                uses_batch_statistics,
                exponential_average_factor,
                self.eps,
            )
        return _MultiNodeBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            exponential_average_factor,
            group,
            type(self).__name__,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", comm={type(self.comm).__name__ if self.comm is not None else None}"


class MultiNodeBatchNorm1d(_MultiNodeBatchNorm):
    """nn.BatchNorm1d over the global batch of all ranks of `comm`; input (N, C) or (N, C, L)."""

    _input_dims = (2, 3)


class MultiNodeBatchNorm2d(_MultiNodeBatchNorm):
    """nn.BatchNorm2d over the global batch of all ranks of `comm`; input (N, C, H, W)."""

    _input_dims = (4,)


class MultiNodeBatchNorm3d(_MultiNodeBatchNorm):
    """nn.BatchNorm3d over the global batch of all ranks of `comm`; input (N, C, D, H, W)."""

    _input_dims = (5,)


_REPLACEMENTS = {
    nn.BatchNorm1d: MultiNodeBatchNorm1d,
    nn.BatchNorm2d: MultiNodeBatchNorm2d,
    nn.BatchNorm3d: MultiNodeBatchNorm3d,
}


def _replacement_for(module: nn.Module):
    for batch_norm_type, replacement in _REPLACEMENTS.items():
        if isinstance(module, batch_norm_type):
            return replacement
    return None


def convert_mnbn_model(module: nn.Module, comm=None) -> nn.Module:
    """Replace every nn.BatchNorm1d/2d/3d in `module` (recursively) by its multi-node counterpart.

    Works like `nn.SyncBatchNorm.convert_sync_batchnorm`: the new layers take over the old ones'
    parameters and buffers (the same tensors, so an optimizer built before the conversion still
    updates them), their requires_grad and the training mode; children are replaced in place and the
    converted module is returned (a new object only when `module` itself is a BatchNorm).
    `comm` is a torch_chainermn communicator, a ProcessGroup, or None for the default group.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"convert_mnbn_model: module must be a torch.nn.Module, got {type(module).__name__}")
    converted = module
    replacement = _replacement_for(module)
    if replacement is not None:
        # Newer torch lets an affine BatchNorm go without bias; keep that choice where it exists.
        options = {"bias": False} if module.affine and module.bias is None else {}
        converted = replacement(
            module.num_features, comm, module.eps, module.momentum, module.affine, module.track_running_stats, **options
        )
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_mnbn_model(child, comm))
    return converted


# ChainerMN's name for the same conversion (it swapped chainer.links.BatchNormalization).
create_mnbn_model = convert_mnbn_model
