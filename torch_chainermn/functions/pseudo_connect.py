"""pseudo_connect: values of some tensors, backward through them and a delegate variable too.

    phi1 = send(z1, comm, rank=1)
    phi2 = send(z2, comm, rank=1)
    psi = pseudo_connect(phi1, phi2)     # psi is phi2, and its backward also reaches the first send

The delegate gets a zero gradient (an empty one, for a send's delegate), which is all its backward
needs to run: ChainerMN's pseudo_connect.
"""

from __future__ import annotations

import torch

from .._arguments import check_tensor, differentiable

USAGE = "pseudo_connect(delegate_variable, *actual_variables)"


class _PseudoConnect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, delegate, *actual):
        ctx.delegate = (delegate.shape, delegate.dtype, delegate.device)
        ctx.mark_non_differentiable(*[t for t in actual if not differentiable(t.dtype)])
        # Returned as they are: autograd makes them outputs of this node (aliases of the inputs).
        return actual

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.delegate
        # A zero gradient, not None: the delegate's own node must run (a send's receives its gradient).
        return (torch.zeros(shape, dtype=dtype, device=device), *grads)


def pseudo_connect(delegate_variable, *actual_variables):
    """`actual_variables` (one tensor, or a tuple of several), hung on `delegate_variable` as well: the
    result's backward runs through both. A None delegate connects nothing (the tensors come back as
    they are). A single tuple argument is taken as the tensors (what a component may return)."""
    op = "pseudo_connect"
    if len(actual_variables) == 1 and isinstance(actual_variables[0], (tuple, list)):
        actual_variables = tuple(actual_variables[0])
    if not actual_variables:
        raise ValueError(f"{op}: give at least one actual variable ({USAGE})")
    actual = [check_tensor(op, f"actual_variables[{i}]", t, USAGE) for i, t in enumerate(actual_variables)]
    if delegate_variable is None:
        return actual[0] if len(actual) == 1 else tuple(actual)
    delegate = check_tensor(op, "delegate_variable", delegate_variable, USAGE)
    if not (torch.is_grad_enabled() and delegate.requires_grad):
        out = actual
    elif not any(differentiable(t.dtype) for t in actual):
        raise ValueError(
            f"{op}: none of actual_variables can carry a gradient (dtypes "
            f"{', '.join(str(t.dtype) for t in actual)}), so the delegate would be cut off"
        )
    else:
        out = _PseudoConnect.apply(delegate, *actual)
    return out[0] if len(out) == 1 else tuple(out)
