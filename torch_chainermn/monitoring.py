"""torch.distributed.monitored_barrier for chainermn groups.

torch's own `dist.monitored_barrier` refuses every backend but gloo. This one has its semantics on
any group whose backend is chainermn: rank 0 waits for every rank to arrive within `timeout`; if one
does not, every rank raises, and rank 0's error names the ranks that did not come ("Rank 1 failed to
pass monitoredBarrier in 1000 ms"; with wait_all_ranks=True, all of them).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def monitored_barrier(group=None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
    group_to_use = dist.distributed_c10d._get_default_group() if group is None else group
    if dist.get_backend(group_to_use) != "chainermn":
        return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ValueError(f"monitored_barrier: timeout must be a datetime.timedelta, got {timeout!r}")
    return group_to_use.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
