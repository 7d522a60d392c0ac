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
- `input_gradients_first` (either schedule): a pipeline's step ends with the stages' last backward
  passes one after another, each waiting for the gradient of the stage after it. The stage with the
  model output then computes the gradients of what it received first (autograd.grad, the graph
  kept), which sends them upstream, and its weights' gradients after (a second backward, which
  computes the input gradients again on the way): the stage before starts its last backward one
  weight-gradient pass sooner. A middle stage does not: its backward starts by receiving its
  gradient, which a second pass would do again.
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
    pieces = [torch.tensor_split(v, m) if isinstance(v, torch.Tensor) and v.dim() > 0 else [v] * m for v in values]
    batches = [tuple(p[k] for p in pieces) for k in range(m)]
    return batches, [len(chunk) for chunk in torch.tensor_split(torch.empty(n, 0), m)]


def _concat(op: str, outputs):
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError(
                f"{op}: with micro_batches > 1 the model output needs a batch dimension to be "
                f"put back together, got a 0-d tensor (compute the loss outside the chain, or use step())"
            )
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
        raise ValueError(
            f"{op}: 1F1B needs one component per rank with a single rank_in and rank_out (a linear "
            f"pipeline); ranks {bad} have other chains"
        )
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
        raise ValueError(
            f"{op}: the ranks' (rank_in, rank_out) {everyone} do not form one linear pipeline "
            f"over all {comm.size} ranks of the communicator (use schedule='gpipe')"
        )
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
    pending, loss_sum, received = {}, None, {}
    for kind, k in _order(chain.schedule, m, stage, stages):
        if kind == "F":
            received[k] = []
            value, is_output = chain.run_components(
                *batches[k],
                gradients_ahead=True,  # it runs every backward
                received=received[k],
            )
            if is_output:
                loss = loss_fn(value, targets[k][0]) if targets is not None else loss_fn(value)
                if losses is not None:
                    losses.append(loss.detach())
                value = loss * (sizes[k] / total if total else 1.0 / m)  # its share of the batch
                loss_sum = value.detach() if loss_sum is None else loss_sum + value.detach()
            pending[k] = value
        else:
            value, inputs = pending.pop(k), received.pop(k)
            if value is None or not value.requires_grad:
                continue
            if k == m - 1 and has_output and chain.input_gradients_first:
                backward_input_first(value, inputs)
            else:
                torch.autograd.backward(value)
    return loss_sum if has_output else None


def _leaves(value: torch.Tensor, stop) -> tuple[list, set]:
    """The leaf tensors `value`'s backward accumulates into without passing a node of `stop`, and the
    ids of those found behind the `stop` nodes."""
    before, behind, seen = {}, set(), set()
    todo = [(value.grad_fn, False)]
    while todo:
        node, past = todo.pop()
        if node is None or (node, past) in seen:
            continue
        seen.add((node, past))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            if past:
                behind.add(id(variable))
            else:
                before[id(variable)] = variable
        past = past or node in stop
        todo.extend((nxt, past) for nxt, _ in node.next_functions)
    return list(before.values()), behind


def backward_input_first(value: torch.Tensor, received) -> None:
    """`value`'s backward, the gradients of the `received` tensors first (see the top of this file)."""
    tensors = [
        t
        for r in received
        for t in (r if isinstance(r, tuple) else (r,))
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    leaves, behind = _leaves(value, {t.grad_fn for t in tensors})
    if not tensors or any(id(leaf) in behind for leaf in leaves):
        torch.autograd.backward(value)  # a leaf reached both ways would take the receives' backward twice
        return
    grads = torch.autograd.grad(value, tensors, retain_graph=True, allow_unused=True)
    given = [(t, g) for t, g in zip(tensors, grads) if g is not None]
    if given:
        torch.autograd.backward([t for t, _ in given], [g for _, g in given])  # the recvs' backward: sent
    if leaves:
        torch.autograd.backward(value, inputs=leaves)
