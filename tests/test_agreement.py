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
