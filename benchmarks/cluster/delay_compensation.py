"""DC-ASGD's delay compensation on top of chainermn's double buffering, for the benchmark only (mode
fp16+db+dc of train_lm.py): does it make one-step-stale gradients train with AdamW?

Double buffering applies at step k the mean of the gradients computed at the parameters of step k-1.
DC-ASGD (Zheng et al., ICML 2017) corrects such a gradient with a first-order term of its change,
the Hessian approximated by the gradient's outer product's diagonal:

    g~ = g + lambda * g * g * (w_k - w_{k-1})

The hook wraps hooks.double_buffering_hook: it keeps each parameter's value from the step before and
corrects the stale mean the wrapped hook hands DDP.
"""

import torch.distributed as dist

from torch_chainermn import hooks


class DelayCompensation:
    def __init__(self, state: hooks.DoubleBufferingState, lam: float):
        self.state = state
        self.lam = lam
        self.previous = {}  # id(param) -> its value at the step before


def delay_compensated_hook(dc: DelayCompensation, bucket: dist.GradBucket):
    stale = hooks.double_buffering_hook(dc.state, bucket)
    grads = bucket.buffer()
    base = grads.data_ptr()
    places = [
        (p, (g.data_ptr() - base) // grads.element_size()) for p, g in zip(bucket.parameters(), bucket.gradients())
    ]
    changes = []
    for p, offset in places:
        now = p.detach().reshape(-1)
        before = dc.previous.get(id(p))
        if before is not None:
            changes.append((offset, now - before))
        dc.previous[id(p)] = now.clone()

    def compensate(fut):
        mean = fut.value()
        for offset, change in changes:
            g = mean[offset : offset + change.numel()]
            g.add_(g * g * change, alpha=dc.lam)
        return mean

    return stale.then(compensate)
