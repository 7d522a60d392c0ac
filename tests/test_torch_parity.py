"""What torch does on gloo, on chainermn too: sparse all_reduce (and DDP with sparse gradients), dense
layouts other than the contiguous one (channels_last), integer AVG as NCCL computes it, the Python
API through torch's debug wrapper, Communicator.split and ProcessGroup.split_group keeping every option, and the "chainermn" name
registered at `import torch` (the torch.backends entry point)."""

import copy
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import simple_sparse_reduce_tests
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_chainermn
from tests.support.collective_cases import expect_value_error
from tests.support.harness import REPO, job_environment, run_job, run_spawn, torchrun


def refused(fn, *words) -> bool:
    expect_value_error(fn, *words)  # raises AssertionError (with the message) otherwise
    return True


def sparse_of(rank: int) -> torch.Tensor:
    indices = torch.tensor([[0, 2, rank + 3], [1, rank, 0]])
    return torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, 10.0 * (rank + 1)]), (6, 4))


def ddp_embedding_step(group) -> list:
    torch.manual_seed(0)
    model = DDP(torch.nn.EmbeddingBag(20, 3, mode="sum", sparse=True), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        optimizer.zero_grad()
        model(torch.tensor([[dist.get_rank(), 5 + step, 7]])).sum().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def parity_cases():
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    outcome = {}

    # Sparse all_reduce: the sum, sparse, as gloo gives it; DDP with sparse gradients matches gloo's.
    mine, theirs = sparse_of(rank), sparse_of(rank)
    dist.all_reduce(mine)
    dist.all_reduce(theirs, group=gloo)
    expected = sum(sparse_of(r).to_dense() for r in range(size))
    outcome["sparse"] = (
        mine.is_sparse and torch.equal(mine.to_dense(), expected) and torch.equal(mine.to_dense(), theirs.to_dense())
    )
    outcome["sparse ddp"] = all(torch.equal(a, b) for a, b in zip(ddp_embedding_step(None), ddp_embedding_step(gloo)))
    # PyTorch's own sparse test (distributed_test.py's _test_sparse_all_reduce_sum): its cases, its check.
    for inputs, outputs in simple_sparse_reduce_tests(rank, size, num_inputs=1):
        dist.all_reduce(inputs[0], dist.ReduceOp.SUM)
        torch.testing.assert_close(inputs[0], outputs[0])
    outcome["upstream sparse"] = True
    outcome["sparse max"] = refused(lambda: dist.all_reduce(sparse_of(rank), op=dist.ReduceOp.MAX), "all_reduce", "SUM")

    # channels_last: elementwise ops and gathers' inputs take it; the result keeps its layout.
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) + rank
    layout = torch.channels_last
    summed = base.to(memory_format=layout)
    dist.all_reduce(summed)
    root = base.to(memory_format=layout)
    dist.broadcast(root, src=1)
    gathered = torch.empty(2 * size, 3, 4, 5)
    dist.all_gather_into_tensor(gathered, base.to(memory_format=layout))
    listed = [torch.empty(2, 3, 4, 5) for _ in range(size)]
    dist.all_gather(listed, base.to(memory_format=layout))
    every = [torch.arange(120, dtype=torch.float32).reshape(2, 3, 4, 5) + r for r in range(size)]
    outcome["channels_last"] = (
        summed.is_contiguous(memory_format=layout)
        and torch.equal(summed, sum(every))
        and torch.equal(root, every[1])
        and torch.equal(gathered, torch.cat(every))
        and all(torch.equal(a, b) for a, b in zip(listed, every))
    )
    # Two ranks laying the same tensor out differently would sum unrelated elements: refused.
    mixed = base.to(memory_format=layout) if rank == 0 else base.clone()
    outcome["mixed layouts"] = refused(lambda: dist.all_reduce(mixed), "all_reduce", "layout")
    outcome["not dense"] = refused(lambda: dist.all_reduce(torch.ones(4, 4)[:, ::2]), "all_reduce", "contiguous")

    # AVG of integers, as NCCL: the sum, divided by the size, truncating toward zero.
    values = torch.tensor([7, -7, 3, 1 + rank], dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.AVG)
    total = sum(torch.tensor([7, -7, 3, 1 + r]) for r in range(size))
    outcome["integer avg"] = torch.equal(values, torch.div(total, size, rounding_mode="trunc"))

    # Communicator.split gives the child every option of the parent.
    options = torch_chainermn.Options(communicator="flat", shared_memory=False, checks="off")
    parent = torch_chainermn.Communicator(dist.new_group(backend="chainermn", pg_options=options))
    child = parent.split(0, rank)
    outcome["split options"] = torch_chainermn.get_options(child.group) == options
    child.finalize()

    # ProcessGroup.split_group (dist.split_group's and DeviceMesh's way, on a GPU machine): a chainermn
    # child with the parent's options over the ranks asked for, None elsewhere; torch's deep copy of
    # the options (what dist.split_group passes) carries them too.
    backend = parent.group._get_backend(torch.device("cpu"))
    both = parent.group.split_group([1, 0], timeout=None, opts=None, group_name="both", group_desc=None)
    summed = torch.full((3,), rank + 1.0)
    both.allreduce([summed]).wait()
    copied = copy.deepcopy(backend.options)
    alone = parent.group.split_group([0], timeout=None, opts=copied, group_name="alone", group_desc=None)
    outcome["split_group"] = (
        backend.supports_splitting
        and torch_chainermn.get_options(both) == options
        and (both.rank(), both.size()) == (rank, size)
        and torch.equal(summed, torch.full((3,), 3.0))
        and (alone is None if rank else torch_chainermn.get_options(alone) == options and alone.size() == 1)
    )
    outcome["split_group bad rank"] = refused(
        lambda: parent.group.split_group([0, 5], timeout=None, opts=None, group_name="bad", group_desc=None),
        "split_group",
        "5",
    )
    return outcome


def test_torch_parity_two_ranks():
    for outcome in run_spawn(parity_cases, 2, timeout=240):
        assert all(outcome.values()), outcome


def debug_wrapper_cases():
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps the backend in its checker; the API finds it."""
    rank = dist.get_rank()
    results = {"options": torch_chainermn.get_options().communicator, "topology": torch_chainermn.topology().size}
    grads = [torch.full((3,), float(rank))]
    torch_chainermn.mean_coalesced(grads)
    results["mean"] = grads[0].tolist()
    comm = torch_chainermn.create_communicator("flat")
    results["communicator"] = comm.communicator_name
    model = DDP(torch.nn.Linear(2, 1))
    model.register_comm_hook(None, torch_chainermn.hooks.fp16_compress_hook)
    model(torch.ones(1, 2)).sum().backward()
    results["hook"] = model.module.weight.grad is not None
    comm.finalize()
    return results


def test_the_api_finds_its_backend_through_the_debug_wrapper():
    for results in run_spawn(debug_wrapper_cases, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=120):
        assert results == {
            "options": "hierarchical",
            "topology": 2,
            "mean": [0.5] * 3,
            "communicator": "flat",
            "hook": True,
        }


AUTOLOAD = """
import torch, torch.distributed as dist, sys
registered = "chainermn" in dist.Backend.backend_list
loaded_early = "torch_chainermn._C" in sys.modules
if registered:
    dist.init_process_group("chainermn", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(3); dist.all_reduce(t); dist.destroy_process_group()
print(registered, loaded_early)
"""


def test_import_torch_registers_the_backend_without_loading_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    on = subprocess.run([sys.executable, "-c", AUTOLOAD], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert on.stdout.split() == ["True", "False"], on.stdout + on.stderr
    off = subprocess.run(
        [sys.executable, "-c", AUTOLOAD],
        cwd="/",
        env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert off.stdout.split() == ["False", "False"], off.stdout + off.stderr
    assert REPO.exists()


def test_memory_soak_gives_every_result_right(tmp_path):
    # benchmarks/soak.py, briefly: every op at random sizes and dtypes, groups made and destroyed; it
    # checks each result and exits 1 on a wrong one (its RSS figures are for docs/benchmarks.md, not asserted).
    command = torchrun(2) + [
        str(REPO / "benchmarks" / "soak.py"),
        "--ops",
        "1500",
        "--group-every",
        "250",
        "--out",
        str(tmp_path / "soak.md"),
    ]
    code, output = run_job(command, job_environment(), timeout=180, what="the soak")
    assert code == 0, output[-3000:]
    assert "| 1 |" in (tmp_path / "soak.md").read_text()
