"""Pipelined micro-batches for MultiNodeChainList (beyond ChainerMN; the model is torch's
torch.distributed.pipelining: its ScheduleGPipe and Schedule1F1B, on this chain's sends and recvs).

Why it overlaps: a send is posted and not waited for, so a stage goes on with micro-batch k+1 while
micro-batch k travels and its successor computes it; in backward, a recv's gradient is posted the
same way. Only receives block, and every rank meets the micro-batches in the same order, so nothing
waits for a rank that is itself waiting.

- `gpipe_forward` (chain(x) with micro_batches=m): every micro-batch's forward, outputs concatenated.
  The single backward that follows runs the micro-batches in reverse order on every rank: autograd
  runs the ready node created last first, and all of micro-batch k+1's nodes were created after
  micro-batch k's.
- `run_schedule` (chain.step(...)): forward and backward of each micro-batch driven here, with the
  loss per micro-batch. "gpipe": all forwards, then all backwards (in forward order, as torch's
  ScheduleGPipe). "1f1b": stage s of S runs S-1-s forwards ahead, then alternates one forward and one
  backward, so at most S-s micro-batches' activations are alive at once; it needs a linear chain
  (one component per rank, a single rank_in and rank_out) covering every rank of the communicator.
"""
from __future__ import annotations

import torch

from ..messages.objects import allgather_small
from ..messages import tensors as wire


def split_batch(op: str, values, m: int):
    """m micro-batches of `values`: every tensor of dim >= 1 split along dim 0 (torch.tensor_split,
    so sizes differ by at most one), anything else repeated. Returns (micro-batches, their sizes)."""
    sizes = {v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"{op}: every tensor input must have the same batch size (dim 0), got {sorted(sizes)}")
    if not sizes:
        if values:
            raise ValueError(f"{op}: micro_batches={m} needs a tensor input with a batch dimension (dim 0)")
        return [() for _ in range(m)], None
    n = sizes.pop()
    if n < m:
        raise ValueError(f"{op}: a batch of {n} cannot be split into micro_batches={m}")
    pieces = [torch.tensor_split(v, m) if isinstance(v, torch.Tensor) and v.dim() > 0 else [v] * m
              for v in values]
    batches = [tuple(p[k] for p in pieces) for k in range(m)]
    return batches, [len(chunk) for chunk in torch.tensor_split(torch.empty(n, 0), m)]


def _concat(op: str, outputs):
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError(f"{op}: with micro_batches > 1 the model output needs a batch dimension to be "
                             f"put back together, got a 0-d tensor (compute the loss outside the chain, or use step())")
        return torch.cat(outputs, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat(op, [o[i] for o in outputs]) for i in range(len(first)))
    raise ValueError(f"{op}: cannot put micro-batch outputs of type {type(first).__name__} back together")


def _join_delegates(delegates):
    from ..functions.pseudo_connect import pseudo_connect
    joined = delegates[0]
    for d in delegates[1:]:
        joined = d if joined is None else (joined if d is None else pseudo_connect(joined, d))
    return joined


def receive_ahead(chain, m: int) -> None:
    """Post the receives of every activation the m micro-batches will receive (one at a time, each
    once the one before it has landed), so that they arrive while this rank computes."""
    for _, rank_in, _ in chain.components():
        for source in rank_in or ():
            if source != chain.comm.rank:
                wire.receive_ahead(chain.comm.group, source, 0, m)


def gpipe_forward(chain, inputs, m: int):
    op = "MultiNodeChainList"
    batches, _ = split_batch(op, inputs, m)
    receive_ahead(chain, m)
    results = [chain.run_components(*batch) for batch in batches]
    if results[0][1]:
        return _concat(op, [value for value, _ in results])
    return _join_delegates([value for value, _ in results])


# ---- schedules ------------------------------------------------------------------------------------

def stage_of(chain) -> tuple[int, int]:
    """(this rank's stage index, number of stages) of a linear chain; asks every rank once."""
    if chain._stages is not None:
        return chain._stages
    op = "step(schedule='1f1b')"
    comm = chain.comm
    mine = chain._rank_inouts
    if len(mine) != 1 or any(r is not None and len(r) != 1 for r in mine[0]):
        shape = None
    else:
        rank_in, rank_out = mine[0]
        shape = (rank_in[0] if rank_in else None, rank_out[0] if rank_out else None)
    everyone = allgather_small(comm.group, shape)
    bad = [r for r, s in enumerate(everyone) if s is None]
    if bad:
        raise ValueError(f"{op}: 1F1B needs one component per rank with a single rank_in and rank_out (a linear "
                         f"pipeline); ranks {bad} have other chains")
    firsts = [r for r, (rank_in, _) in enumerate(everyone) if rank_in is None]
    order, seen = [], set()
    at = firsts[0] if len(firsts) == 1 else None
    while at is not None and at not in seen:
        order.append(at)
        seen.add(at)
        nxt = everyone[at][1]
        if nxt is not None and everyone[nxt][0] != at:
            break
        at = nxt
    if len(firsts) != 1 or len(order) != comm.size or everyone[order[-1]][1] is not None:
        raise ValueError(f"{op}: the ranks' (rank_in, rank_out) {everyone} do not form one linear pipeline "
                         f"over all {comm.size} ranks of the communicator (use schedule='gpipe')")
    chain._stages = (order.index(comm.rank), comm.size)
    return chain._stages


def _order(schedule: str, m: int, stage: int, stages: int):
    """The schedule of one rank: ("F", k) and ("B", k) in the order they run."""
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    ahead = min(stages - 1 - stage, m)
    steps = [("F", k) for k in range(ahead)]
    for k in range(m - ahead):
        steps += [("F", ahead + k), ("B", k)]
    return steps + [("B", k) for k in range(m - ahead, m)]


def run_schedule(chain, inputs, target, loss_fn, losses):
    op = "step"
    m = chain.micro_batches
    has_output = chain.has_output()
    if has_output and loss_fn is None:
        raise ValueError(f"{op}: this rank ({chain.comm.rank}) holds the model output: pass loss_fn")
    batches, sizes = split_batch(op, inputs, m)
    targets = split_batch(op, (target,), m)[0] if target is not None else None
    if sizes is None and targets is not None:
        sizes = [len(t[0]) for t in targets]
    total = sum(sizes) if sizes else None
    if chain.schedule == "1f1b":
        stage, stages = stage_of(chain)
    else:
        stage, stages = 0, 1
    receive_ahead(chain, m)
    pending, loss_sum = {}, None
    for kind, k in _order(chain.schedule, m, stage, stages):
        if kind == "F":
            value, is_output = chain.run_components(*batches[k], gradients_ahead=True)  # it runs every backward
            if is_output:
                loss = loss_fn(value, targets[k][0]) if targets is not None else loss_fn(value)
                if losses is not None:
                    losses.append(loss.detach())
                value = loss * (sizes[k] / total if total else 1.0 / m)  # its share of the batch
                loss_sum = value.detach() if loss_sum is None else loss_sum + value.detach()
            pending[k] = value
        else:
            value = pending.pop(k)
            if value is not None and value.requires_grad:
                torch.autograd.backward(value)
    return loss_sum if has_output else None
