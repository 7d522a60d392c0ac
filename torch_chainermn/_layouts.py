"""Where each parameter's values lie in a flat buffer of gradients, and how to find them again after
DDP lays its buckets out anew (it does once, after the first step).

A layout is a tuple of (id(param), offset, numel), one entry per parameter, in the buffer's order. Ids,
not the tensors: comparing tensors with == compares their values. Double buffering (a stale mean read
into the new buckets), the compressed mean's residuals (what a node owes each parameter) and the
overlap (which parameters a bucket's mean updates) all go by layouts, and by_parameter() is the one
way to follow values from old layouts into new ones.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["bucket_layout", "by_parameter", "layout_of", "read_into"]


def layout_of(tensors, params) -> tuple:
    """The layout of parameters whose gradients lie end to end as `tensors` do."""
    out, offset = [], 0
    for tensor, param in zip(tensors, params):
        out.append((id(param), offset, tensor.numel()))
        offset += tensor.numel()
    return tuple(out)


def bucket_layout(bucket: dist.GradBucket) -> tuple:
    """The layout of a DDP bucket's parameters in its flat buffer (bucket views may leave gaps)."""
    grads = bucket.buffer()
    base = grads.data_ptr()
    return tuple(
        (id(p), (g.data_ptr() - base) // grads.element_size(), g.numel())
        for p, g in zip(bucket.parameters(), bucket.gradients())
    )


def by_parameter(laid_out, into: dict | None = None) -> dict:
    """{id(param): its values} from (layout, flat tensor) pairs: views of the flat tensors, to be read
    into wherever the parameter lies now. Empty flat tensors (a rank that holds nothing) add nothing."""
    found = {} if into is None else into
    for layout, flat in laid_out:
        if flat.numel():
            for param_id, offset, numel in layout:
                found[param_id] = flat[offset : offset + numel]
    return found


def read_into(found: dict, layout: tuple, views) -> None:
    """Write each parameter's values from `found` (by_parameter) into its view of a new layout; zeros
    for a parameter that had none (it had no gradient bucket before)."""
    for (param_id, _, _), view in zip(layout, views):
        values = found.get(param_id)
        if values is None:
            view.zero_()
        else:
            view.copy_(values.view(view.shape))
