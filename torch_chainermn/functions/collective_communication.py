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

from .._messages import allgather_small, check_rank
from ._arguments import anchor, as_communicator, check_tensor, grad_needed


def _comm(op, comm, usage):
    if isinstance(comm, torch.Tensor):
        raise ValueError(f"{op}: comm must be a communicator, got a tensor: the arguments are swapped "
                         f"(ChainerMN's order is {usage})")
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


def _anyone_needs_grad(comm, mine: bool) -> bool:
    return any(allgather_small(comm.group, bool(mine)))


def _flagged(x: torch.Tensor, flag: bool) -> torch.Tensor:
    """x's data, marked requires_grad when `flag`: the communicator's methods carry that mark to the
    other ranks with the data, which is how they learn that backward will come."""
    x = x.detach()
    return x.requires_grad_(True) if flag and (x.dtype.is_floating_point or x.dtype.is_complex) else x


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
    if comm.rank == root:
        x = check_tensor(op, "x", x, usage, comm.rank)
    y = comm.bcast(_flagged(x, grad_needed(x)) if comm.rank == root else None, root=root)
    needs = y.requires_grad and torch.is_grad_enabled()  # the root's flag travels with the data
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
    """Every rank's x, as a tuple on `root`; on the other ranks a delegate variable (an empty tensor)
    that carries the graph to this gather, so their backward takes part in its backward (the
    gradients are scattered back from root)."""
    op, usage = "gather", "gather(comm, x, root=0)"
    comm = _comm(op, comm, usage)
    root = _root(op, root, comm)
    x = check_tensor(op, "x", x, usage, comm.rank)
    needs = _anyone_needs_grad(comm, grad_needed(x))
    ys = comm.gather(x.detach(), root=root)
    if not needs:
        return tuple(ys) if comm.rank == root else torch.zeros((), device=x.device)
    mine = grad_needed(x)
    return _Gather.apply(comm, root, [y.detach() for y in ys] if ys is not None else None, mine,
                         x if mine else anchor())


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
    xs_list = None
    if comm.rank == root:
        if isinstance(xs, torch.Tensor):
            xs_list = list(xs.unbind(0)) if xs.dim() > 0 else [xs]
        elif isinstance(xs, (tuple, list)):
            xs_list = [check_tensor(op, f"xs[{i}]", t, usage, comm.rank) for i, t in enumerate(xs)]
        else:
            check_tensor(op, "xs", xs, usage, comm.rank)
    root_needs = comm.rank == root and xs_list is not None and grad_needed(*xs_list)
    # The piece's spec carries requires_grad: mark every piece when root needs a gradient.
    pieces = [_flagged(t, root_needs) for t in xs_list] if xs_list is not None else xs
    y = comm.scatter(pieces, root=root)
    needs = y.requires_grad and torch.is_grad_enabled()
    y = y.detach()
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
            blocks[r, :g.numel()] = g.reshape(-1)
        mine = torch.empty(width, dtype=blocks.dtype, device=blocks.device)
        dist.reduce_scatter_single(mine, blocks.reshape(-1), op=dist.ReduceOp.SUM, group=comm.group)
        gx = mine[:ctx.numels[comm.rank]].reshape(ctx.shape)
        return None, None, None, (gx if ctx.is_x else _zeros_like_meta(ctx.meta))


def allgather(comm, x):
    """Every rank's x, as a tuple on every rank (shapes may differ); backward gives each rank the sum
    of every rank's gradient for its x (a reduce-scatter)."""
    op, usage = "allgather", "allgather(comm, x)"
    comm = _comm(op, comm, usage)
    x = check_tensor(op, "x", x, usage, comm.rank)
    mine = grad_needed(x)
    ys = comm.allgather(_flagged(x, mine))
    needs = torch.is_grad_enabled() and any(y.requires_grad for y in ys)  # every rank's flag came along
    ys = [y.detach() for y in ys]
    if not needs:
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
    if not isinstance(xs, (tuple, list)) or len(xs) != comm.size:
        raise ValueError(f"{op}: xs must be a tuple or list of {comm.size} tensors on rank {comm.rank}, "
                         f"got {type(xs).__name__}" + (f" of length {len(xs)}" if isinstance(xs, (tuple, list))
                                                       else ""))
    xs = [check_tensor(op, f"xs[{i}]", t, usage, comm.rank) for i, t in enumerate(xs)]
    mine = grad_needed(*xs)
    needs = _anyone_needs_grad(comm, mine)
    ys = [y.detach() for y in comm.alltoall([t.detach() for t in xs])]
    if not needs:
        return tuple(ys)
    return _Alltoall.apply(comm, ys, mine, *(xs if mine else [anchor()]))
