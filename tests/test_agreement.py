"""Calls the ranks disagree on raise on every rank, write no output, and leave the group in step.

One job per configuration runs the whole battery of tests/support/mismatch_cases.py on one group (each case
followed by a correct all_reduce), so a handful of process launches cover every case.
"""

import pytest
import torch.distributed as dist

from tests.support.harness import run_mpiexec, run_spawn
from tests.support.mismatch_cases import CASES, POINT_TO_POINT, run_battery


def check_battery(outcomes, size):
    problems = []
    for name in CASES:
        per_rank = [outcomes[r][name] for r in range(size)]
        # Point to point concerns the two ranks of the message; the receiver must raise.
        concerned = [1] if name in POINT_TO_POINT else range(size)
        for r in concerned:
            got = per_rank[r]["got"]
            if not (got.startswith("ValueError") or got.startswith("RuntimeError")):
                problems.append(f"{name}: rank {r} got {got[:200]}")
        for r in range(size):
            if not per_rank[r]["untouched"]:
                problems.append(f"{name}: rank {r}'s output was written")
            if not per_rank[r]["in_step"]:
                problems.append(f"{name}: rank {r}'s next all_reduce was wrong or failed")
    assert problems == [], "\n".join(problems)


def messages(outcomes, name, size):
    return [outcomes[r][name]["got"] for r in range(size)]


def check_messages(outcomes, size):
    """The same message on every rank, naming the field and the ranks."""
    sizes = messages(outcomes, "all_reduce: 10 vs 20 elements", size)
    for text in sizes:
        assert "rank 1 has 20 torch.float32 elements" in text, text
        assert ("rank 0 has 10" in text) or ("ranks 0," in text and "have 10" in text), text
    refused = messages(outcomes, "all_reduce: non-contiguous tensor on one rank", size)
    assert "contiguous" in refused[1]
    for r in range(size):
        if r != 1:
            assert "rank 1 refused the call" in refused[r] and "contiguous" in refused[r], refused[r]
    ops = messages(outcomes, "all_reduce vs broadcast", size)
    assert all("called all_reduce" in t and "called broadcast" in t for t in ops), ops
    roots = messages(outcomes, "broadcast: src 0 vs 1", size)
    assert all("src=1" in t and "src=0" in t for t in roots), roots
    splits = messages(outcomes, "all_to_all_single: splits that disagree", size)
    assert all("rank 1 expects 3 elements from rank 0, which sends 2" in t for t in splits), splits
    recv = outcomes[1]["recv: 10 elements into a 5-element tensor"]["got"]
    assert "expected 5 torch.float32 elements from rank 0" in recv and "sent 10" in recv, recv


def battery():
    return run_battery()


@pytest.mark.parametrize("shm", ["1", "0"])
def test_every_rank_raises_over_gloo(shm):
    outcomes = run_spawn(battery, 2, env={"CHAINERMN_SHM": shm}, timeout=240, op_timeout=20)
    check_battery(outcomes, 2)
    check_messages(outcomes, 2)


def test_every_rank_raises_on_four_ranks_over_two_nodes():
    outcomes = run_spawn(battery, 4, env={"CHAINERMN_RANKS_PER_NODE": "2"}, timeout=300, op_timeout=20)
    check_battery(outcomes, 4)
    check_messages(outcomes, 4)


@pytest.mark.mpi
def test_every_rank_raises_over_mpi():
    outcomes = run_mpiexec(battery, 2, timeout=240, op_timeout=20)
    check_battery(outcomes, 2)
    check_messages(outcomes, 2)


def sequence_numbers():
    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(dist.distributed_c10d._get_pg_default_device(group))
    before = backend._get_sequence_number_for_group()
    dist.all_reduce(__import__("torch").ones(2))
    dist.barrier()
    return before, backend._get_sequence_number_for_group()


def test_debug_detail_wraps_the_backend():
    """With TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps the backend in its checker, which needs
    sequence numbers; torch's own mismatch check then runs too."""
    outcomes = run_spawn(sequence_numbers, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=120)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == outcomes[0][0] + 2


def carried_checks():
    """What each op returned, and how many cross-rank checks rode in its own first exchange."""
    import torch
    import torch_chainermn

    backend = torch_chainermn._backend.backend_of()
    rank = dist.get_rank()
    out = {}

    def counted(name, call):
        before = backend.checks_carried()
        result = call()
        out[name] = (backend.checks_carried() - before, result)

    def all_reduce(t, **kw):
        work = dist.all_reduce(t, **kw)
        if work is not None:
            work.wait()
        return t.unique().tolist()

    small = torch.full((16,), float(rank + 1))
    counted("small all_reduce", lambda: all_reduce(small))  # on the caller: one barrier, check included
    counted("small async all_reduce", lambda: all_reduce(small, async_op=True))  # on the worker: the same
    counted("1 MiB all_reduce", lambda: all_reduce(torch.full((1 << 18,), float(rank + 1))))  # chunks: alone
    counted(
        "float16 AVG", lambda: all_reduce(torch.full((16,), float(rank + 1), dtype=torch.float16), op=dist.ReduceOp.AVG)
    )  # scaled in place first: alone, before
    counted("empty all_reduce", lambda: all_reduce(torch.empty(0)))  # nothing moves: alone
    counted("barrier", lambda: dist.barrier())
    root = torch.full((4,), float(rank))
    counted("broadcast", lambda: (dist.broadcast(root, src=1), root.tolist())[1])
    gathered = [torch.empty(2) for _ in range(dist.get_world_size())]
    counted(
        "all_gather",
        lambda: (dist.all_gather(gathered, torch.full((2,), float(rank))), [g.tolist() for g in gathered])[1],
    )
    counted(
        "all_to_all",
        lambda: (dist.all_to_all_single(out := torch.empty(2), torch.full((2,), float(rank))), out.tolist())[1],
    )  # through the library beside the segment: alone
    return out


def test_a_small_collective_carries_its_check_in_its_one_barrier():
    """Over shared memory a small collective's fingerprint rides in the barrier that moves its data
    (ShmTransport::round); ops whose body writes first, ops of many chunks, empty ones and those the
    segment hands to its library send it alone, first. Results stay right either way; the mismatch
    battery above runs every pairing of the two (100 vs 600000 elements, 0 vs 5, a refusal)."""
    outcomes = run_spawn(carried_checks, 2, env={"CHAINERMN_SHM": "1"}, timeout=120)
    expected = {
        "small all_reduce": (1, [3.0]),
        "small async all_reduce": (1, [6.0]),
        "1 MiB all_reduce": (0, [3.0]),
        "float16 AVG": (0, [1.5]),
        "empty all_reduce": (0, []),
        "barrier": (1, None),
        "broadcast": (1, [1.0] * 4),
        "all_gather": (1, [[0.0, 0.0], [1.0, 1.0]]),
    }
    for rank, outcome in enumerate(outcomes):
        for name, want in expected.items():
            assert outcome[name] == want, (rank, name, outcome[name])
        assert outcome["all_to_all"] == (0, [0.0, 1.0]), (rank, outcome["all_to_all"])
