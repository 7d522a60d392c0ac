"""AllreducePersistent: average the floating-point buffers (BatchNorm's running statistics) over ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._backend import group_of

__all__ = ["AllreducePersistent"]


class AllreducePersistent:
    """Average every floating-point buffer of `model` across the ranks of `comm`, in place.

    ChainerMN's extension of the same name: buffers are what Chainer called persistent values, above
    all BatchNorm's running mean and variance, which plain data-parallel training lets drift apart
    on every rank. Averaging them before evaluating or saving gives statistics estimated from every
    rank's data. Integer buffers (num_batches_tracked) are left untouched.

        average_buffers = AllreducePersistent(model, comm)
        ...
        average_buffers()          # collective: every rank calls it

    The buffers are packed into one flat buffer per (device, dtype), so each call makes one allreduce
    per dtype. Every rank's model must have the same buffers, in the same order.
    """

    def __init__(self, model: torch.nn.Module, comm=None):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"AllreducePersistent: model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.comm = comm

    def __call__(self, *unused) -> None:
        """Average the buffers now. Extra positional arguments (a trainer) are accepted and ignored."""
        group = group_of(self.comm, "AllreducePersistent")
        world_size = dist.get_world_size(group)
        buffers_by_kind: dict[tuple[str, str], list[torch.Tensor]] = {}
        for buffer in self.model.buffers():
            if buffer.is_floating_point():
                buffers_by_kind.setdefault((str(buffer.device), str(buffer.dtype)), []).append(buffer)
        # Sorted, so that every rank issues its allreduces in the same order whatever order the
        # dtypes first appear in.
        for kind in sorted(buffers_by_kind):
            buffers = buffers_by_kind[kind]
            # float16/bfloat16 sums are carried in float32 so that they cannot overflow or round away.
            wire_dtype = torch.promote_types(buffers[0].dtype, torch.float32)
            packed = torch.cat([b.detach().reshape(-1).to(wire_dtype) for b in buffers])
            dist.all_reduce(packed, group=group)
            packed.div_(world_size)
            offset = 0
            with torch.no_grad():
                for buffer in buffers:
                    count = buffer.numel()
                    buffer.copy_(packed[offset : offset + count].view_as(buffer))
                    offset += count

    # ChainerMN extensions were called by the trainer; this spelling reads better without one.
    allreduce = __call__
