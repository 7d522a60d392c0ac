"""Differentiable collectives (ChainerMN's chainermn.functions.bcast, gather, scatter, alltoall,
allgather): the data moves through the communicator's methods, and each backward is the adjoint
collective:

    bcast(comm, x, root)    <->  sum of the gradients, reduced to root
    gather(comm, x, root)   <->  scatter of the gradients from root
    scatter(comm, xs, root) <->  gather of the gradients to root
    allgather(comm, x)      <->  reduce-scatter of sums (each rank's gradient summed over everyone's)
    alltoall(comm, xs)      <->  alltoall of the gradients, back to where each piece came from

Shapes may differ from rank to rank where the communicator's method allows it (gather, scatter,
allgather, alltoall); dtypes may not. A collective's backward is collective too: every rank runs it,
so every rank's result must reach its backward. A rank that gets nothing back (gather, off the
root) gets a delegate variable to keep in its graph. Whether backward happens at all is agreed by
the ranks in forward (any rank's input requiring grad makes every rank take part).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..messages.framing import check_rank
from ..messages.objects import agree
from .._arguments import anchor, as_communicator, check_tensor, grad_needed


def _comm(op, comm, usage):
    if isinstance(comm, torch.Tensor):
        raise ValueError(
            f"{op}: comm must be a communicator, got a tensor: the arguments are swapped (ChainerMN's order is {usage})"
        )
    return as_communicator(op, comm, usage)


def _root(op, root, comm) -> int:
    try:
        return check_rank(op, "root", root, comm.size)
    except ValueError as error:
        raise ValueError(f"{error} (on rank {comm.rank})") from None


def _zeros_like_meta(meta):
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _meta(t):
    return (t.shape, t.dtype, t.device)


def _flags(comm, check) -> list:
    """Every rank's `check()` (whether its input needs a gradient; None off the root where only the
    root's input counts), on every rank. A ValueError on one rank is raised on every rank, so that no
    rank is left alone in the collective."""
    return agree(comm.group, check)


def _tensors(op, name, xs, size, usage, rank) -> list:
    if isinstance(xs, torch.Tensor):
        if xs.dim() == 0 or xs.shape[0] != size:
            raise ValueError(
                f"{op}: {name} must have {size} rows (one per rank) on rank {rank}, got shape {tuple(xs.shape)}"
            )
        return list(xs.unbind(0))
    if not isinstance(xs, (tuple, list)) or len(xs) != size:
        got = f"a {type(xs).__name__} of length {len(xs)}" if isinstance(xs, (tuple, list)) else type(xs).__name__
        raise ValueError(f"{op}: {name} must be a tuple or list of {size} tensors on rank {rank}, got {got}")
    return [check_tensor(op, f"{name}[{i}]", t, usage, rank) for i, t in enumerate(xs)]


# ---- bcast ---------------------------------------------------------------------------------------------


class _Bcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, root, y, x_or_anchor):
        ctx.comm, ctx.root, ctx.meta = comm, root, _meta(x_or_anchor)
        return y

    @staticmethod
    def backward(ctx, gy):
        comm, root = ctx.comm, ctx.root
        total = gy.detach().clone(memory_format=torch.contiguous_format)
        dist.reduce(total, op=dist.ReduceOp.SUM, group=comm.group, group_dst=root)
        return None, None, None, (total if comm.rank == root else _zeros_like_meta(ctx.meta))


def bcast(comm, x, root: int = 0):
    """Rank `root`'s x on every rank (x is ignored elsewhere and may be None); backward sums every
    rank's gradient into root's x."""
    op, usage = "bcast", "bcast(comm, x, root=0)"
    comm = _comm(op, comm, usage)
    root = _root(op, root, comm)
    flags = _flags(comm, lambda: grad_needed(check_tensor(op, "x", x, usage, comm.rank)) if comm.rank == root else None)
    needs = flags[root]
    y = comm.bcast(x.detach() if comm.rank == root else None, root=root)
    y = y.detach() if comm.rank != root else x.detach().clone()
    if not needs:
        return y
    return _Bcast.apply(comm, root, y, x if comm.rank == root else anchor())


# ---- gather and scatter -----------------------------------------------------------------------------


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, root, ys, is_x, x_or_anchor):
        ctx.comm, ctx.root, ctx.meta, ctx.is_x = comm, root, _meta(x_or_anchor), is_x
        if comm.rank == root:
            return tuple(ys)
        return torch.zeros((), device=x_or_anchor.device)  # the delegate variable

    @staticmethod
    def backward(ctx, *grads):
        comm, root = ctx.comm, ctx.root
        pieces = [g.detach() for g in grads] if comm.rank == root else None
        gx = comm.scatter(pieces, root=root).detach()
        return None, None, None, None, (gx if ctx.is_x else _zeros_like_meta(ctx.meta))


def gather(comm, x, root: int = 0):
    """Every rank's x, as a tuple on `root`; on the other ranks a delegate variable (a scalar zero)
    that carries the graph to this gather, so their backward takes part in its backward (the
    gradients are scattered back from root)."""
    op, usage = "gather", "gather(comm, x, root=0)"
    comm = _comm(op, comm, usage)
    root = _root(op, root, comm)
    flags = _flags(comm, lambda: grad_needed(check_tensor(op, "x", x, usage, comm.rank)))
    ys = comm.gather(x.detach(), root=root)
    if not any(flags):
        return tuple(ys) if comm.rank == root else torch.zeros((), device=x.device)
    mine = flags[comm.rank]
    return _Gather.apply(
        comm, root, [y.detach() for y in ys] if ys is not None else None, mine, x if mine else anchor()
    )


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, root, y, *xs_or_anchor):
        ctx.comm, ctx.root = comm, root
        ctx.metas = [_meta(t) for t in xs_or_anchor]
        return y

    @staticmethod
    def backward(ctx, gy):
        comm, root = ctx.comm, ctx.root
        gathered = comm.gather(gy.detach().contiguous(), root=root)
        if comm.rank == root:
            return (None, None, None, *gathered)
        return (None, None, None, _zeros_like_meta(ctx.metas[0]))


def scatter(comm, xs, root: int = 0):
    """Rank `root`'s xs[i] on rank i (xs: a sequence of `size` tensors of one dtype, shapes may differ;
    ignored elsewhere); backward gathers the gradients back into root's xs."""
    op, usage = "scatter", "scatter(comm, xs, root=0)"
    comm = _comm(op, comm, usage)
    root = _root(op, root, comm)
    checked = {}

    def check():
        if comm.rank != root:
            return None
        checked["xs"] = _tensors(op, "xs", xs, comm.size, usage, comm.rank)
        return grad_needed(*checked["xs"])

    needs = _flags(comm, check)[root]
    xs_list = checked.get("xs")
    y = comm.scatter([t.detach() for t in xs_list] if comm.rank == root else None, root=root).detach()
    if not needs:
        return y
    if comm.rank == root:
        return _Scatter.apply(comm, root, y, *xs_list)
    return _Scatter.apply(comm, root, y, anchor())


# ---- allgather and alltoall -------------------------------------------------------------------------


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, ys, is_x, x_or_anchor):
        ctx.comm, ctx.meta, ctx.is_x = comm, _meta(x_or_anchor), is_x
        ctx.numels = [y.numel() for y in ys]
        ctx.shape = ys[comm.rank].shape
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        comm = ctx.comm
        # Reduce-scatter of sums: rank r's gradient is the sum over every rank of its grads[r].
        # Blocks are padded to the largest piece, as reduce_scatter moves equal blocks.
        width = max(ctx.numels)
        blocks = torch.zeros(comm.size, width, dtype=grads[0].dtype, device=grads[0].device)
        for r, g in enumerate(grads):
            blocks[r, : g.numel()] = g.reshape(-1)
        mine = torch.empty(width, dtype=blocks.dtype, device=blocks.device)
        dist.reduce_scatter_single(mine, blocks.reshape(-1), op=dist.ReduceOp.SUM, group=comm.group)
        gx = mine[: ctx.numels[comm.rank]].reshape(ctx.shape)
        return None, None, None, (gx if ctx.is_x else _zeros_like_meta(ctx.meta))


def allgather(comm, x):
    """Every rank's x, as a tuple on every rank (shapes may differ); backward gives each rank the sum
    of every rank's gradient for its x (a reduce-scatter)."""
    op, usage = "allgather", "allgather(comm, x)"
    comm = _comm(op, comm, usage)
    flags = _flags(comm, lambda: grad_needed(check_tensor(op, "x", x, usage, comm.rank)))
    mine = flags[comm.rank]
    ys = [y.detach() for y in comm.allgather(x.detach())]
    if not any(flags):
        return tuple(ys)
    return _Allgather.apply(comm, ys, mine, x if mine else anchor())


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, ys, is_x, *xs_or_anchor):
        ctx.comm, ctx.is_x = comm, is_x
        ctx.metas = [_meta(t) for t in xs_or_anchor]
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        back = ctx.comm.alltoall([g.detach() for g in grads])
        if ctx.is_x:
            return (None, None, None, *[b.detach() for b in back])
        return (None, None, None, _zeros_like_meta(ctx.metas[0]))


def alltoall(comm, xs):
    """Rank i's xs[j] on rank j: returns the tuple of what every rank sent to this one (shapes may
    differ); backward sends each gradient back to the rank its piece came from."""
    op, usage = "alltoall", "alltoall(comm, xs)"
    comm = _comm(op, comm, usage)

    def check():
        if isinstance(xs, torch.Tensor):  # alltoall takes a sequence (rows of one tensor would be views)
            raise ValueError(
                f"{op}: xs must be a tuple or list of {comm.size} tensors on rank {comm.rank}, got a tensor"
            )
        return grad_needed(*_tensors(op, "xs", xs, comm.size, usage, comm.rank))

    flags = _flags(comm, check)
    mine = flags[comm.rank]
    ys = [y.detach() for y in comm.alltoall([t.detach() for t in xs])]
    if not any(flags):
        return tuple(ys)
    return _Alltoall.apply(comm, ys, mine, *(xs if mine else [anchor()]))
