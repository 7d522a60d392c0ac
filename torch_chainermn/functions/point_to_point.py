"""Differentiable send and recv (ChainerMN's chainermn.functions.send / recv).

    phi = send(z, comm, rank=1)                          # rank 0: a delegate variable
    z = recv(comm, rank=0)                               # rank 1: what rank 0 sent, in the graph
    y = recv(comm, rank=1, delegate_variable=phi)        # rank 0 again: backward reaches the send

recv's backward sends the gradient back to the sender; send's backward receives it and passes it
on. A send has no output of its own, so it returns a *delegate variable*: a scalar zero whose only
job is to carry the graph to the send (a scalar, so that `phi.backward()` works as in ChainerMN). Whatever a rank backprops from must reach every send
through delegate variables, or the peer that waits for the gradient would wait forever (it raises
within the group timeout instead, naming the send or recv and the fix).
"""

from __future__ import annotations

import torch

from ..messages import tensors as wire
from .._arguments import (
    anchor,
    as_communicator,
    check_peer,
    check_tag,
    check_tensor,
    differentiable,
    grad_needed,
    is_communicator,
)

SEND_USAGE = "send(x, communicator, rank, tag=0)"
RECV_USAGE = "recv(communicator, rank, delegate_variable=None, tag=0, device=None, force_tuple=False)"


class _Link:
    """One message of a (group, peer, tag) pair: enough to find its gradient in backward."""

    def __init__(self, comm, peer: int, tag: int, seq: int):
        self.comm, self.peer, self.tag, self.seq = comm, peer, tag, seq


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, link: _Link, spec: wire.Spec, *xs):
        ctx.link, ctx.spec = link, spec
        ctx.device = xs[0].device
        return torch.zeros((), device=xs[0].device)  # the delegate variable: a scalar 0, so phi.backward() works

    @staticmethod
    def backward(ctx, _):
        link, spec = ctx.link, ctx.spec
        what = f"send #{link.seq} to rank {link.peer} (tag {link.tag}) on rank {link.comm.rank}"
        waiting = (
            f"its backward waited for the gradient from rank {link.peer}, whose backward did not reach the "
            f"matching recv within the group timeout"
        )
        grads, got = wire.recv_tensors(
            link.comm.group, link.peer, link.tag, wire.KIND_GRADIENT, link.seq, what, waiting, device=ctx.device
        )
        wanted = [(dtype, shape) for dtype, requires_grad, shape in spec.meta if requires_grad]
        if [(d, s) for d, _, s in got.meta] != wanted:
            raise RuntimeError(
                f"{what}: the gradient from rank {link.peer} is {got.describe()}, "
                f"expected {', '.join(f'{d}{list(s)}' for d, s in wanted)}"
            )
        grads = iter(grads)
        return (None, None, *(next(grads) if requires_grad else None for _, requires_grad, _ in spec.meta))


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, link: _Link, spec: wire.Spec, received: list, _anchor):
        ctx.link, ctx.spec = link, spec
        ctx.anchor = (_anchor.shape, _anchor.dtype, _anchor.device)
        ctx.mark_non_differentiable(*[t for t in received if not differentiable(t.dtype)])
        return tuple(received)

    @staticmethod
    def backward(ctx, *grads):
        link, spec = ctx.link, ctx.spec
        # Only what the sender asked a gradient for goes back: its send's backward expects exactly that.
        back = [
            g.to(spec.device) if g.device.type != spec.device else g
            for g, (_, requires_grad, _) in zip(grads, spec.meta)
            if requires_grad
        ]
        if back:
            what = (
                f"the gradient sent back by recv #{link.seq} from rank {link.peer} (tag {link.tag}) on rank "
                f"{link.comm.rank} was never collected: rank {link.peer}'s backward did not reach the "
                f"matching send within the group timeout"
            )
            wire.send_tensors(link.comm.group, link.peer, link.tag, wire.KIND_GRADIENT, link.seq, back, True, what)
        shape, dtype, device = ctx.anchor
        return None, None, None, torch.zeros(shape, dtype=dtype, device=device)


def send(x, communicator, rank: int, tag: int = 0) -> torch.Tensor:
    """Send `x` (a tensor, or a tuple/list of tensors) to `rank`; returns the delegate variable.

    The tensors arrive at `rank`'s recv with their shapes and dtypes (the receiver needs neither).
    The send is posted and not waited for, so the caller goes on computing while it travels
    (torch_chainermn.functions.drain waits). If any of the tensors requires grad, the delegate does,
    and its backward receives the gradient from `rank` (sent by the backward of `rank`'s recv).
    """
    return send_activation(x, communicator, rank, tag)


def send_activation(x, communicator, rank: int, tag: int = 0, gradients_ahead: bool = False) -> torch.Tensor:
    """send, for MultiNodeChainList. `gradients_ahead`: the caller will surely run this send's
    backward (a pipeline schedule runs every backward itself), so the receive of the gradient is
    posted at once and the gradient lands while this rank computes."""
    op = "send"
    comm = as_communicator(op, communicator, SEND_USAGE)
    is_tuple = isinstance(x, (tuple, list))
    xs = list(x) if is_tuple else [x]
    if is_communicator(x):  # swapped arguments: this rank's own mistake, nothing was meant to be sent
        check_tensor(op, "x", x, SEND_USAGE, comm.rank)
    peer = check_peer(op, "rank", rank, comm)
    tag = check_tag(op, tag, comm)
    state = wire.pair(comm.group, peer, tag)
    seq = next(state.sent)
    link = _Link(comm, peer, tag, seq)
    what = (
        f"send #{seq} to rank {peer} (tag {tag}) on rank {comm.rank} was never received: rank {peer} did not "
        f"call the matching recv within the group timeout"
    )
    try:
        if is_tuple and not xs:
            raise ValueError(
                f"{op}: x must hold at least one tensor, got an empty {type(x).__name__} (on rank {comm.rank})"
            )
        wire.check_sendable(op, "x", xs, comm.rank)
    except ValueError as error:
        wire.send_failure(comm.group, peer, tag, error, what)  # the receiver raises too, instead of waiting
        raise
    if not torch.is_grad_enabled():
        xs = [t.detach() for t in xs]
    spec = wire.Spec.of(xs, is_tuple)
    wire.send_tensors(comm.group, peer, tag, wire.KIND_ACTIVATION, seq, xs, is_tuple, what)
    if grad_needed(*xs):
        if gradients_ahead:
            wire.receive_ahead(comm.group, peer, tag, 1)
        return _Send.apply(link, spec, *xs)
    return torch.zeros((), device=xs[0].device)


def recv(
    communicator,
    rank: int,
    delegate_variable: torch.Tensor | None = None,
    tag: int = 0,
    device=None,
    force_tuple: bool = False,
):
    """What `rank` sent with `send`: a tensor, or a tuple if it sent a tuple of several (or force_tuple).

    Received tensors require grad where the sender's did; their backward sends the gradient back to
    `rank`. With `delegate_variable` (an earlier send's result on this rank) the received tensors
    hang on it, so backward continues from this recv to that send. `device`: where the tensors go
    (default: where they travelled, i.e. the sender's device kind, CUDA on the current device).
    """
    op = "recv"
    comm = as_communicator(op, communicator, RECV_USAGE)
    peer = check_peer(op, "rank", rank, comm)
    tag = check_tag(op, tag, comm)
    if delegate_variable is not None:
        check_tensor(op, "delegate_variable", delegate_variable, RECV_USAGE)
    state = wire.pair(comm.group, peer, tag)
    seq = next(state.received)
    what = f"recv #{seq} from rank {peer} (tag {tag}) on rank {comm.rank}"
    waiting = (
        f"rank {peer} sent nothing within the group timeout (if it is waiting in a backward, a delegate "
        f"variable was dropped on one of the two ranks)"
    )
    received, spec = wire.recv_tensors(
        comm.group,
        peer,
        tag,
        wire.KIND_ACTIVATION,
        seq,
        what,
        waiting,
        device=None if device is None else torch.device(device),
    )
    outputs = _connect(op, comm, peer, tag, seq, spec, received, delegate_variable)
    if len(outputs) == 1 and not force_tuple:
        return outputs[0]
    return tuple(outputs)


def _connect(op, comm, peer, tag, seq, spec, received, delegate):
    """The received tensors in the graph: differentiable where the sender wants a gradient (or where
    they must carry the delegate variable on), with backward sending gradients back."""
    delegate_live = delegate is not None and grad_needed(delegate)
    wanted = [requires_grad and differentiable(dtype) for dtype, requires_grad, _ in spec.meta]
    if not torch.is_grad_enabled() or not (any(wanted) or delegate_live):
        return received
    if not any(differentiable(t.dtype) for t in received):
        raise ValueError(
            f"{op}: delegate_variable given on rank {comm.rank}, but nothing received from rank "
            f"{peer} can carry a gradient ({spec.describe()}); join it with "
            f"pseudo_connect(delegate_variable, ...) on a floating tensor instead"
        )
    return list(_Recv.apply(_Link(comm, peer, tag, seq), spec, received, anchor(delegate)))
