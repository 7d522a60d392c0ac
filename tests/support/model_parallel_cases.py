"""The model-parallel checks, run as batteries: one multi-process job runs every check and reports,
per check, None (passed) or the traceback; tests/test_functions.py and tests/test_model_parallel.py
assert on their parts of the report. Processes are costly on a small machine, checks are cheap.

Every check compares against the same computation on one process: every rank builds every part of
the model from one seed (float64), keeps its own part, and also runs the whole model locally.
"""

from __future__ import annotations

import datetime
import traceback

import torch
import torch.distributed as dist

import torch_chainermn
from torch_chainermn import functions as F
from torch_chainermn.communicator import Communicator

from tests.support import harness

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def close(actual, expected, what):
    assert actual is not None, f"{what}: no gradient"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.allclose(actual, expected, **TOL), f"{what}: {actual} != {expected}"


def data(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=DT)


def leaf(seed, *shape):
    return data(seed, *shape).requires_grad_(True)


def sub_communicator(size, timeout=60.0):
    """A communicator of world ranks [0, size) (None elsewhere), with a bounded timeout so a failed
    check cannot keep the others waiting for long."""
    group = dist.new_group(list(range(size)), backend="chainermn", timeout=datetime.timedelta(seconds=timeout))
    return Communicator(group) if dist.get_rank() < size else None


# ==== functions =====================================================================================


def check_send_recv_chain(comm):
    """A chain over every rank: h <- tanh(h @ W_r), sent on; tuples with an int tensor and a float32
    tensor travel along (no gradient for the int)."""
    rank, size = comm.rank, comm.size
    ws = [leaf(100 + r, 3, 3) for r in range(size)]
    x = data(7, 4, 3)
    labels = torch.arange(4) * 10
    extra = data(8, 2, 5).float().t()  # non-contiguous float32
    if rank == 0:
        h = torch.tanh(x @ ws[0])
        phi = F.send((h, labels, extra), comm, rank=1)
        phi.backward()
    else:
        h, got_labels, got_extra = F.recv(comm, rank=rank - 1)
        assert torch.equal(got_labels, labels) and not got_labels.requires_grad
        assert torch.equal(got_extra, extra.contiguous()) and got_extra.dtype == torch.float32
        got_extra.add_(0)  # a tensor of its own: in-place ops are allowed
        h = torch.tanh(h @ ws[rank])
        if rank < size - 1:
            F.send((h, got_labels, got_extra), comm, rank=rank + 1).backward()
        else:
            (h**2).sum().backward()
    F.drain(comm)
    ref = [w.detach().clone().requires_grad_() for w in ws]
    h = x
    for w in ref:
        h = torch.tanh(h @ w)
    (h**2).sum().backward()
    close(ws[rank].grad, ref[rank].grad, f"grad of W on rank {rank}")


def check_seed_delegate_variable(comm):
    """The guide's Model_0 / Model_1: rank 0 sends, receives back with delegate_variable=phi, rank 1
    returns its send's delegate. Repeated, to show the pair stays in step."""
    if comm.rank > 1:
        return
    w_f, w_g, w_h = leaf(1, 4, 5), leaf(2, 5, 5), leaf(3, 5, 2)
    for step in range(2):
        x = data(10 + step, 6, 4)
        if comm.rank == 0:
            phi = F.send(x @ w_f, comm, rank=1)
            z = F.recv(comm, rank=1, delegate_variable=phi)
            y = (z @ w_h).sin().sum()
            y.backward()
        else:
            z = F.recv(comm, rank=0)
            phi = F.send(torch.relu(z @ w_g), comm, rank=0)
            phi.backward()
    F.drain(comm)
    ref = [w.detach().clone().requires_grad_() for w in (w_f, w_g, w_h)]
    for step in range(2):
        (torch.relu(data(10 + step, 6, 4) @ ref[0] @ ref[1]) @ ref[2]).sin().sum().backward()
    mine = (w_f, w_h) if comm.rank == 0 else (w_g,)
    theirs = (ref[0], ref[2]) if comm.rank == 0 else (ref[1],)
    for w, r in zip(mine, theirs):
        close(w.grad, r.grad, f"seed example 1, rank {comm.rank}")
    if comm.rank == 1:
        assert w_f.grad is None and w_h.grad is None


def check_seed_two_sends_pseudo_connect(comm):
    """The guide's second example: two sends joined by pseudo_connect, received in order."""
    if comm.rank > 1:
        return
    w1, w2, w3 = leaf(21, 3, 4), leaf(22, 3, 4), leaf(23, 4, 1)
    x = data(24, 5, 3)
    if comm.rank == 0:
        phi1 = F.send(x @ w1, comm, rank=1)
        phi2 = F.send((x @ w2).cos(), comm, rank=1)
        psi = F.pseudo_connect(phi1, phi2)
        assert psi.shape == phi2.shape and psi.requires_grad
        psi.backward()
    else:
        z1 = F.recv(comm, rank=0)
        z2 = F.recv(comm, rank=0)
        ((z1 * z2) @ w3).sum().backward()
    F.drain(comm)
    ref = [w.detach().clone().requires_grad_() for w in (w1, w2, w3)]
    (((x @ ref[0]) * (x @ ref[1]).cos()) @ ref[2]).sum().backward()
    pairs = [(w1, ref[0]), (w2, ref[1])] if comm.rank == 0 else [(w3, ref[2])]
    for w, r in pairs:
        close(w.grad, r.grad, f"seed example 2, rank {comm.rank}")


def check_pseudo_connect_alone():
    """On one process: values of the actual variables; backward through them and the delegate."""
    a, b, c = leaf(31, 3), leaf(32, 2, 2), leaf(33, 4)
    delegate = (a * 2).sum()
    y, z = F.pseudo_connect(delegate, b, torch.arange(3))
    assert torch.equal(y, b) and torch.equal(z, torch.arange(3)) and not z.requires_grad
    (y * c[:2]).sum().backward()
    assert torch.equal(a.grad, torch.zeros(3, dtype=DT))  # reached, with a zero gradient
    assert torch.equal(b.grad, c[:2].detach().expand(2, 2))
    assert F.pseudo_connect(None, b) is b


def check_bcast(comm):
    rank, size = comm.rank, comm.size
    for root in range(size):
        x = leaf(40 + root, 2, 3) if rank == root else None
        y = F.bcast(comm, x, root=root)
        assert torch.equal(y.detach(), data(40 + root, 2, 3))
        c = data(50 + rank, 2, 3)
        (y * c).sum().backward()
        if rank == root:
            close(x.grad, sum(data(50 + r, 2, 3) for r in range(size)), f"bcast grad at root {root}")


def check_gather(comm):
    rank, size = comm.rank, comm.size
    for root in range(size):
        x = leaf(60 + rank, rank + 1, 3)  # shapes differ by rank
        out = F.gather(comm, x, root=root)
        if rank == root:
            assert len(out) == size
            for r, got in enumerate(out):
                assert torch.equal(got.detach(), data(60 + r, r + 1, 3))
            sum((got * data(70 + r, r + 1, 3)).sum() for r, got in enumerate(out)).backward()
        else:
            assert out.dim() == 0 and out.requires_grad  # a delegate variable
            out.backward()
        close(x.grad, data(70 + rank, rank + 1, 3), f"gather grad on rank {rank}, root {root}")


def check_scatter(comm):
    rank, size = comm.rank, comm.size
    for root in range(size):
        xs = [leaf(80 + r, r + 2) for r in range(size)] if rank == root else None
        y = F.scatter(comm, xs, root=root)
        assert torch.equal(y.detach(), data(80 + rank, rank + 2))
        ((y**2) * (rank + 1)).sum().backward()
        if rank == root:
            for r, x in enumerate(xs):
                close(x.grad, 2 * (r + 1) * data(80 + r, r + 2), f"scatter grad of xs[{r}], root {root}")
    # One tensor with a row per rank, as ChainerMN's scatter takes too.
    xs = leaf(90, size, 3) if rank == 0 else None
    y = F.scatter(comm, xs, root=0)
    (y * (rank + 1)).sum().backward()
    if rank == 0:
        close(xs.grad, torch.arange(1, size + 1, dtype=DT)[:, None].expand(size, 3), "scatter rows grad")


def check_allgather(comm):
    rank, size = comm.rank, comm.size
    for shapes in ("equal", "ragged"):
        shape = (lambda r: (2, 3)) if shapes == "equal" else (lambda r: (r + 1, 2))
        x = leaf(100 + rank, *shape(rank))
        ys = F.allgather(comm, x)
        for r, y in enumerate(ys):
            assert torch.equal(y.detach(), data(100 + r, *shape(r)))
        sum((y * data(1000 * rank + r, *shape(r))).sum() for r, y in enumerate(ys)).backward()
        close(x.grad, sum(data(1000 * r + rank, *shape(rank)) for r in range(size)), f"allgather ({shapes}) grad")


def check_ensemble_allgather(comm):
    """The guide's Example 2: each rank's prediction, allgathered, stacked and averaged."""
    rank, size = comm.rank, comm.size
    ws = [leaf(120 + r, 4, 3) for r in range(size)]
    x = data(130, 5, 4)
    h = F.allgather(comm, x @ ws[rank])
    mean = torch.stack(h, dim=0).mean(dim=0)
    (mean**2).sum().backward()  # every rank backprops its own copy: gradients add up
    ref = [w.detach().clone().requires_grad_() for w in ws]
    ((torch.stack([x @ w for w in ref]).mean(0) ** 2).sum() * size).backward()
    close(ws[rank].grad, ref[rank].grad, "ensemble grad")


def check_alltoall(comm):
    rank, size = comm.rank, comm.size
    xs = [leaf(200 + 10 * rank + j, j + 1, rank + 1) for j in range(size)]
    ys = F.alltoall(comm, xs)
    for i, y in enumerate(ys):
        assert torch.equal(y.detach(), data(200 + 10 * i + rank, rank + 1, i + 1))
    sum((y * data(300 + 10 * rank + i, rank + 1, i + 1)).sum() for i, y in enumerate(ys)).backward()
    for j, x in enumerate(xs):
        close(x.grad, data(300 + 10 * j + rank, j + 1, rank + 1), f"alltoall grad of xs[{j}]")


def expect(error_type, fn, *words):
    try:
        fn()
    except error_type as error:
        for word in words:
            assert word in str(error), f"{word!r} not in {error}"
        return str(error)
    raise AssertionError(f"no {error_type.__name__} raised (wanted one naming {words})")


def check_function_errors(comm):
    rank, size = comm.rank, comm.size
    x = torch.ones(2, requires_grad=True)
    expect(ValueError, lambda: F.send(x, comm, rank=size), "send", "rank", f"on rank {rank}")
    expect(ValueError, lambda: F.send(x, comm, rank=rank), "send", "other than this one")
    expect(ValueError, lambda: F.gather(comm, x, root=-1), "gather", "root", f"on rank {rank}")
    expect(ValueError, lambda: F.send(comm, x, 1 - rank if size > 1 else 0), "send", "swapped")
    expect(ValueError, lambda: F.recv(comm, rank=-1), "recv", "rank")
    expect(ValueError, lambda: F.recv(comm, (rank + 1) % size, tag=-3), "recv", "tag")
    expect(ValueError, lambda: F.bcast(x, comm), "bcast", "swapped")
    expect(ValueError, lambda: F.alltoall(comm, [x]), "alltoall", "xs", f"rank {rank}")
    expect(ValueError, lambda: F.pseudo_connect(x, "y"), "pseudo_connect", "actual_variables[0]")
    # A mistake on one rank makes every rank of a collective raise (no one is left in it alone).
    expect(ValueError, lambda: F.allgather(comm, x if rank else "x"), "allgather", "on rank 0")
    expect(ValueError, lambda: F.scatter(comm, [x] * (size + 1) if rank == 0 else None), "scatter", "xs")
    expect(ValueError, lambda: F.bcast(comm, None, root=size - 1), "bcast", "x", f"on rank {size - 1}")
    # A sender's mistake reaches the receiver instead of leaving it waiting.
    if rank == 0:
        expect(ValueError, lambda: F.send((x, "not a tensor"), comm, rank=1), "send", "x[1]")
    elif rank == 1:
        expect(RuntimeError, lambda: F.recv(comm, rank=0), "rank 0 could not send", "x[1]")


def function_checks(comm):
    return [
        ("send_recv_chain", lambda: check_send_recv_chain(comm)),
        ("seed_delegate_variable", lambda: check_seed_delegate_variable(comm)),
        ("seed_two_sends_pseudo_connect", lambda: check_seed_two_sends_pseudo_connect(comm)),
        ("pseudo_connect_alone", check_pseudo_connect_alone),
        ("bcast", lambda: check_bcast(comm)),
        ("gather", lambda: check_gather(comm)),
        ("scatter", lambda: check_scatter(comm)),
        ("allgather", lambda: check_allgather(comm)),
        ("ensemble_allgather", lambda: check_ensemble_allgather(comm)),
        ("alltoall", lambda: check_alltoall(comm)),
        ("function_errors", lambda: check_function_errors(comm)),
    ]


# ==== running a battery =============================================================================


def run_checks(checks, report: dict, prefix: str = "") -> None:
    """Run each (name, fn) in order, recording None or the traceback; ranks meet after each check."""
    for name, fn in checks:
        try:
            fn()
            report[prefix + name] = None
        except Exception:  # noqa: BLE001  reported per check
            report[prefix + name] = traceback.format_exc()
        dist.barrier()


def battery(sizes, parts):
    """Every rank: the checks of `parts` ("functions", "model_parallel") on communicators of each size."""
    from tests.support import model_parallel_chain_cases as chain_cases

    report = {}
    for size in sizes:
        comm = sub_communicator(size)
        if "functions" in parts:
            run_checks(
                function_checks(comm) if comm else [(n, lambda: None) for n, _ in function_checks(None)],
                report,
                f"functions[{size}]:",
            )
        if "model_parallel" in parts:
            checks = chain_cases.chain_checks(comm, size)
            run_checks(checks if comm else [(n, lambda: None) for n, _ in checks], report, f"chain[{size}]:")
    if "model_parallel" in parts:
        run_checks(chain_cases.world_checks(), report, "world:")
    return report


@harness.cached_launch
def _run_battery():
    """Run once per session; a failure of the job as a whole (any error) is kept too, so that the other
    tests report it without running the job again."""
    return harness.run_spawn(battery, 4, (2, 3, 4), ("functions", "model_parallel"), timeout=300, op_timeout=60)


def report():
    """The battery's report, run once per session on 4 ranks (communicators of 2, 3 and 4 ranks in
    it): {check: [None or traceback, per rank]}."""
    results = _run_battery()
    return {name: [r.get(name) for r in results] for name in results[0]}


def assert_passed(name: str) -> None:
    results = report()
    assert name in results, f"no check named {name} in the report ({sorted(results)})"
    failures = [f"{name} on rank {r}:\n{tb}" for r, tb in enumerate(results[name]) if tb]
    assert not failures, "\n".join(failures)


# ==== CUDA (a GPU machine only) =====================================================================


def cuda_checks():
    """send/recv, a pipelined chain and two collectives with CUDA tensors on a 2-rank world, against
    the same computation on the CPU of one process."""
    from tests.support import model_parallel_chain_cases as chain_cases

    comm = Communicator()
    rank, cuda = comm.rank, torch.device("cuda", 0)
    w = [leaf(1 + r, 4, 4).to(cuda).detach().requires_grad_() for r in range(2)]
    x = data(3, 5, 4).to(cuda)
    if rank == 0:
        phi = F.send(torch.tanh(x @ w[0]), comm, rank=1)
        assert phi.device.type == "cuda"
        phi.backward()
    else:
        h = F.recv(comm, rank=0)
        assert h.device.type == "cuda"
        (torch.tanh(h @ w[1]) ** 2).sum().backward()
    F.drain(comm)
    ref = [leaf(1 + r, 4, 4) for r in range(2)]
    (torch.tanh(torch.tanh(data(3, 5, 4) @ ref[0]) @ ref[1]) ** 2).sum().backward()
    close(w[rank].grad.cpu(), ref[rank].grad, "CUDA send/recv grad")
    ys = F.allgather(comm, x[: rank + 1] * (rank + 1))
    assert [y.device.type for y in ys] == ["cuda", "cuda"]
    y = F.bcast(comm, x if rank == 0 else None)
    assert y.device.type == "cuda" and torch.equal(y.cpu(), data(3, 5, 4))
    # A pipelined 2-stage chain, 1F1B, on the GPU.
    stage = chain_cases.built(40 + rank, chain_cases.Stage, 4)
    reference = torch.nn.Sequential(*[chain_cases.built(40 + s, chain_cases.Stage, 4) for s in range(2)])
    target = data(701, 10, 4)
    torch.nn.functional.mse_loss(reference(data(700, 10, 4)), target).backward()
    chain = torch_chainermn.MultiNodeChainList(comm, micro_batches=4, schedule="1f1b")
    chain.add_link(stage.to(cuda), rank_in=None if rank == 0 else 0, rank_out=1 if rank == 0 else None)
    chain.step(
        *((data(700, 10, 4).to(cuda),) if rank == 0 else ()),
        target=target.to(cuda) if rank else None,
        loss_fn=torch.nn.functional.mse_loss,
    )
    close(stage.lin.weight.grad.cpu(), reference[rank].lin.weight.grad, "CUDA 1F1B grad")
    return True
