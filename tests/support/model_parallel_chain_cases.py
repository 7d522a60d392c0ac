"""MultiNodeChainList, pipelining, the multi-node RNN, hybrid parallelism and the forgotten-delegate
error: checks of the battery in model_parallel_cases.py (same conventions: float64, every rank
builds the whole model from seeds and compares its own part with one process's computation)."""

from __future__ import annotations

import contextlib
import copy
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as nnf

import torch_chainermn
from torch_chainermn import MultiNodeChainList, create_multi_node_n_step_rnn
from torch_chainermn import functions as F
from torch_chainermn.communicator import Communicator
from torch_chainermn.messages import tensors as wire

from tests.support.model_parallel_cases import DT, close, data, expect

LR = 0.1


class MLP(torch.nn.Module):
    """ChainerMN's example MLP."""

    def __init__(self, n_in, n_hidden, n_out):
        super().__init__()
        self.l1 = torch.nn.Linear(n_in, n_hidden)
        self.l2 = torch.nn.Linear(n_hidden, n_hidden)
        self.l3 = torch.nn.Linear(n_hidden, n_out)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


class PlainSGD(torch.optim.Optimizer):
    """Plain SGD as a torch.optim.Optimizer, without torch.optim's own machinery: its first use
    imports torch._dynamo, which costs seconds in every process of a test job."""

    def __init__(self, params, lr):  # Optimizer.__init__ is what imports torch._dynamo
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.defaults = {"lr": lr}
        self.state = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def built(seed, cls, *args):
    torch.manual_seed(seed)
    return cls(*args).to(DT)


def same_parameters(mine, reference, what):
    for (name, p), (_, q) in zip(mine.named_parameters(), reference.named_parameters()):
        close(p.detach(), q.detach(), f"{what}: {name}")


def same_grads(mine, reference, what):
    for (name, p), (_, q) in zip(mine.named_parameters(), reference.named_parameters()):
        close(p.grad, q.grad, f"{what}: grad of {name}")


# ---- ChainerMN's split MLP (rank 0 -> rank 1 -> rank 0), trained ------------------------------------


def check_split_mlp_training(comm, micro_batches):
    if comm.rank > 1:
        return
    parts = [built(1, MLP, 6, 8, 5), built(2, MLP, 5, 8, 4), built(3, MLP, 4, 8, 3)]
    reference = torch.nn.Sequential(*copy.deepcopy(parts))
    chain = MultiNodeChainList(comm, micro_batches=micro_batches)
    if comm.rank == 0:
        chain.add_link(parts[0], rank_in=None, rank_out=1)
        chain.add_link(parts[2], rank_in=1, rank_out=None)
    else:
        chain.add_link(parts[1], rank_in=0, rank_out=0)
    optimizer = PlainSGD(chain.parameters(), lr=LR)
    ref_optimizer = PlainSGD(reference.parameters(), lr=LR)
    for step in range(3):
        x, t = data(500 + step, 10, 6), torch.arange(10) % 3
        if comm.rank == 0:
            nnf.cross_entropy(chain(x), t).backward()
        else:
            chain().backward()
        optimizer.step()
        optimizer.zero_grad()
        nnf.cross_entropy(reference(x), t).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    mine = [(parts[0], reference[0]), (parts[2], reference[2])] if comm.rank == 0 else [(parts[1], reference[1])]
    for part, ref in mine:
        same_parameters(part, ref, f"split MLP after 3 steps (micro_batches={micro_batches}), rank {comm.rank}")


# ---- a graph with tuples, several rank_in and rank_out, and a hand-over to this rank itself ------------


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.u, self.v = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

    def forward(self, h):
        return torch.tanh(self.u(h)), self.v(h)


class Join(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.d = torch.nn.Linear(3, 2), torch.nn.Linear(4, 2)

    def forward(self, pair, d):
        u, v = pair
        return self.w(u * v) + self.d(d)


def check_graph_chain(comm, micro_batches):
    """rank 0: A -> [rank 1, rank 0]; D (from rank 0) -> rank 2. rank 1: B (from 0) -> rank 2, a tuple.
    rank 2: C (from [1, 0]) -> output. Reference: C(B(A(x)), D(A(x)))."""
    if comm.rank > 2:
        return
    a, d = built(11, torch.nn.Linear, 5, 4), built(12, torch.nn.Linear, 4, 4)
    b, c = built(13, Pair), built(14, Join)
    x = data(600, 6, 5)
    chain = MultiNodeChainList(comm, micro_batches=micro_batches)
    if comm.rank == 0:
        chain.add_link(a, rank_in=None, rank_out=[1, 0])
        chain.add_link(d, rank_in=0, rank_out=2)
        out = chain(x)
        assert out.dim() == 0  # a delegate variable
        out.backward()
    elif comm.rank == 1:
        chain.add_link(b, rank_in=0, rank_out=2)
        chain().backward()
    else:
        chain.add_link(c, rank_in=[1, 0], rank_out=None)
        (chain() ** 2).mean().backward()
    ref = [copy.deepcopy(m) for m in (a, d, b, c)]
    h = ref[0](x)
    (ref[3](ref[2](h), ref[1](h)) ** 2).mean().backward()
    mine = {0: [(a, ref[0]), (d, ref[1])], 1: [(b, ref[2])], 2: [(c, ref[3])]}[comm.rank]
    for m, r in mine:
        same_grads(m, r, f"graph chain (micro_batches={micro_batches}), rank {comm.rank}")


# ---- pipelining: every schedule gives the unpipelined gradients ------------------------------------------


class Stage(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)

    def forward(self, h):
        return torch.tanh(self.lin(h))


def check_pipeline_schedules(comm):
    size, rank = comm.size, comm.rank
    stages = [built(40 + s, Stage, 4) for s in range(size)]
    x, target = data(700, 10, 4), data(701, 10, 4)  # 10 samples in 4 micro-batches: 3, 3, 2, 2
    reference = torch.nn.Sequential(*copy.deepcopy(stages))
    ref_loss = nnf.mse_loss(reference(x), target)
    ref_loss.backward()
    rank_in = rank - 1 if rank > 0 else None
    rank_out = rank + 1 if rank < size - 1 else None
    last = rank == size - 1
    for variant in ("unpipelined", "forward", "gpipe", "1f1b", "gpipe first", "1f1b first"):
        module = copy.deepcopy(stages[rank])
        first = variant.endswith("first")
        chain = MultiNodeChainList(
            comm,
            micro_batches=1 if variant == "unpipelined" else 4,
            schedule="1f1b" if variant.startswith("1f1b") else "gpipe",
            input_gradients_first=first,
        )
        chain.add_link(module, rank_in=rank_in, rank_out=rank_out)
        inputs = (x,) if rank == 0 else ()
        if variant in ("unpipelined", "forward"):
            out = chain(*inputs)
            (nnf.mse_loss(out, target) if last else out).backward()
        else:
            losses = []
            with sends_and_weight_gradients(module) as events:
                loss = chain.step(*inputs, target=target if last else None, loss_fn=nnf.mse_loss, losses=losses)
            if last:
                close(loss, ref_loss.detach(), f"{variant} loss")
                assert len(losses) == 4
                # The last micro-batch's gradient goes upstream before (with input_gradients_first)
                # or after its weight gradient.
                assert events[-2:] == (["sent", "weight"] if first else ["weight", "sent"]), (variant, events)
            else:
                assert loss is None
        same_grads(module, reference[rank], f"{variant} pipeline of {size}, stage {rank}")


@contextlib.contextmanager
def sends_and_weight_gradients(module):
    """The order of this rank's gradient sends ("sent") and of `module`'s weight gradients ("weight")."""
    events, send_tensors = [], wire.send_tensors

    def recorded(*args, **kwargs):
        if args[3] == wire.KIND_GRADIENT:
            events.append("sent")
        return send_tensors(*args, **kwargs)

    hook = module.lin.weight.register_post_accumulate_grad_hook(lambda _: events.append("weight"))
    wire.send_tensors = recorded
    try:
        yield events
    finally:
        wire.send_tensors = send_tensors
        hook.remove()


# ---- the multi-node RNN: an encoder on rank 0, a decoder on rank 1 -----------------------------------------


def check_multi_node_rnn(comm):
    if comm.rank > 1:
        return
    for cls in (torch.nn.LSTM, torch.nn.GRU):
        enc, dec = built(50, cls, 3, 5, 1, True, True), built(51, cls, 3, 5, 1, True, True)
        head = built(52, torch.nn.Linear, 5, 2)
        src, tgt = data(800, 4, 6, 3), data(801, 4, 7, 3)
        if comm.rank == 0:
            rnn = create_multi_node_n_step_rnn(enc, comm, rank_in=None, rank_out=1)
            _, _, phi = rnn(src)
            phi.backward()
        else:
            rnn = create_multi_node_n_step_rnn(dec, comm, rank_in=0, rank_out=None)
            ys, _, delegate = rnn(tgt)
            assert delegate is None
            (head(ys) ** 2).mean().backward()
        ref = [copy.deepcopy(m) for m in (enc, dec, head)]
        _, hidden = ref[0](src)
        ys, _ = ref[1](tgt, hidden)
        (ref[2](ys) ** 2).mean().backward()
        pairs = [(enc, ref[0])] if comm.rank == 0 else [(dec, ref[1]), (head, ref[2])]
        for m, r in pairs:
            same_grads(m, r, f"multi-node {cls.__name__}, rank {comm.rank}")


def check_chain_errors(comm):
    rank, size = comm.rank, comm.size
    chain = MultiNodeChainList(comm)
    expect(ValueError, lambda: chain.add_link(torch.nn.Linear(2, 2), rank_out=size), "add_link", "rank_out")
    expect(ValueError, lambda: chain.add_link(lambda x: x), "add_link", "link")
    expect(ValueError, lambda: MultiNodeChainList(comm, micro_batches=0), "micro_batches")
    expect(ValueError, lambda: MultiNodeChainList(comm, schedule="zigzag"), "schedule")
    expect(ValueError, lambda: MultiNodeChainList(comm, input_gradients_first="yes"), "input_gradients_first")
    expect(ValueError, lambda: create_multi_node_n_step_rnn(torch.nn.Linear(2, 2), comm), "n_step_rnn", "rnn")
    lonely = MultiNodeChainList(comm, micro_batches=2)
    lonely.add_link(torch.nn.Linear(2, 2).to(DT))
    expect(ValueError, lambda: lonely.step(data(1, 4, 2)), "step", "loss_fn")
    expect(ValueError, lambda: lonely(data(1, 1, 2)), "cannot be split")
    # 1F1B needs a linear pipeline: here rank 0 has two components; every rank learns it.
    tangled = MultiNodeChainList(comm, micro_batches=2, schedule="1f1b")
    tangled.add_link(Stage(2).to(DT), rank_in=None if rank == 0 else rank - 1, rank_out=(rank + 1) % size)
    if rank == 0:
        tangled.add_link(Stage(2).to(DT), rank_in=size - 1, rank_out=None)
    expect(
        ValueError, lambda: tangled.step(data(2, 4, 2), target=data(3, 4, 2), loss_fn=nnf.mse_loss), "1F1B", "linear"
    )


def chain_checks(comm, size):
    checks = [
        ("split_mlp_training", lambda: check_split_mlp_training(comm, 1)),
        ("split_mlp_training_pipelined", lambda: check_split_mlp_training(comm, 3)),
        ("pipeline_schedules", lambda: check_pipeline_schedules(comm)),
        ("multi_node_rnn", lambda: check_multi_node_rnn(comm)),
        ("chain_errors", lambda: check_chain_errors(comm)),
    ]
    if size >= 3:
        checks += [
            ("graph_chain", lambda: check_graph_chain(comm, 1)),
            ("graph_chain_pipelined", lambda: check_graph_chain(comm, 2)),
        ]
    return checks


# ---- on the whole world -----------------------------------------------------------------------------------


def check_hybrid():
    """4 ranks: 2 pipeline stages, each replicated twice. Stage s of replica r is world rank 2r + s;
    each replica trains on its half of the batch; the stages' multi-node optimizers average over the
    replicas of the stage. After the optimizer's first call (which only broadcasts) and 3 steps, every
    rank's stage equals the one-process model trained on the whole batch."""
    if dist.get_world_size() != 4:
        return
    world = Communicator()
    replica, stage = world.rank // 2, world.rank % 2
    pipe = world.split(replica, stage)  # the two stages of one replica
    replicas = world.split(stage, replica)  # one stage's replicas: data parallel
    parts = [built(60, MLP, 6, 8, 5), built(61, MLP, 5, 8, 3)]
    reference = torch.nn.Sequential(*copy.deepcopy(parts))
    module = parts[stage]
    with torch.no_grad():  # the optimizer's first step makes rank 0 of the replicas' parameters everyone's
        for p in module.parameters():
            p.add_(replica)
    chain = MultiNodeChainList(pipe, micro_batches=2)
    chain.add_link(module, rank_in=None if stage == 0 else 0, rank_out=1 if stage == 0 else None)
    optimizer = torch_chainermn.create_multi_node_optimizer(PlainSGD(module.parameters(), lr=LR), replicas)
    ref_optimizer = PlainSGD(reference.parameters(), lr=LR)
    for step in range(4):
        x, t = data(900 + step, 8, 6), (torch.arange(8) * (step + 1)) % 3
        half = slice(4 * replica, 4 * replica + 4)
        if stage == 0:
            chain(x[half]).backward()
        else:
            nnf.cross_entropy(chain(), t[half]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step > 0:
            nnf.cross_entropy(reference(x), t).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
    same_parameters(module, reference[stage], f"hybrid: stage {stage} of replica {replica}")
    pipe.finalize()
    replicas.finalize()


def check_forgotten_delegate():
    """Rank 1 drops the delegate of its first send (its second recv has no delegate_variable): rank 0's
    backward would wait forever for that send's gradient. It raises within the group timeout naming
    the send; rank 1's next recv finds rank 0's gradient where an activation was due, and says why."""
    group = dist.new_group([0, 1], backend="chainermn", timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() > 1:
        return
    comm = Communicator(group)
    w = torch.ones(3, 3, dtype=DT, requires_grad=True)
    if comm.rank == 0:
        phi1 = F.send(data(1, 2, 3) @ w, comm, rank=1)
        y1 = F.recv(comm, rank=1, delegate_variable=phi1)
        phi2 = F.send(y1 * 2, comm, rank=1)
        y2 = F.recv(comm, rank=1, delegate_variable=phi2)
        expect(
            dist.DistBackendError,
            lambda: y2.sum().backward(),
            "send #0 to rank 1",
            "delegate_variable",
            "pseudo_connect",
            "timed out",
        )
    else:
        z1 = F.recv(comm, rank=0)
        F.send(z1 @ w, comm, rank=0)  # phi1 dropped: the mistake
        z2 = F.recv(comm, rank=0)  # no delegate_variable
        F.send(z2 @ w, comm, rank=0).backward()  # reaches the second send only
        expect(
            RuntimeError,
            lambda: F.recv(comm, rank=0),
            "gradient where an activation was due",
            "send #0 to rank 0",
            "delegate",
        )


def world_checks():
    return [("hybrid_parallel", check_hybrid), ("forgotten_delegate", check_forgotten_delegate)]
