"""ChainerMN's allreduce strategies on simulated topologies, over Gloo (spawn) and MPI (mpiexec)."""

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from tests.support import strategy_cases
from tests.support.harness import cached_launch, run_mpiexec, run_spawn

# (name, world size, per-process env, expected (intra_size of rank 0, inter_size))
TOPOLOGIES = {
    "1x4": (4, {"CHAINERMN_RANKS_PER_NODE": "4"}, None, (4, 1)),
    "2x2": (4, {"CHAINERMN_RANKS_PER_NODE": "2"}, None, (2, 2)),
    "4x1": (4, {"CHAINERMN_RANKS_PER_NODE": "1"}, None, (1, 4)),
    "2+2+1": (5, {"CHAINERMN_RANKS_PER_NODE": "2"}, None, (2, 3)),  # nodes of unequal size
    "1+2": (
        3,
        {},
        {0: {"CHAINERMN_HOSTNAME": "a"}, 1: {"CHAINERMN_HOSTNAME": "b"}, 2: {"CHAINERMN_HOSTNAME": "b"}},
        (1, 2),
    ),
}
# Every topology runs in-process over the same strategies (tests/test_threads.py, 9 topologies); here
# real processes over each library, on the shapes that differ: nodes of 2, three nodes of unequal
# size, and a node of one. (1x4 and 4x1 are one level, and 3x2 has nothing 2x2 and 2+2+1 lack: the
# in-process tests cover them.)
CONFIGS = [("gloo", t) for t in ("2x2", "2+2+1", "1+2")] + [("mpi", t) for t in ("2x2", "2+2+1")]


@cached_launch
def outcomes(transport, topology):
    size, env, rank_env, _ = TOPOLOGIES[topology]
    if transport == "gloo":
        return run_spawn(strategy_cases.run_strategy_cases, size, env=env, rank_env=rank_env, timeout=600)
    return run_mpiexec(strategy_cases.run_strategy_cases, size, env=env, timeout=600)


@pytest.mark.parametrize(
    "transport,topology",
    [pytest.param(t, top, id=f"{t}-{top}", marks=[pytest.mark.mpi] if t == "mpi" else []) for t, top in CONFIGS],
)
@pytest.mark.parametrize("case", strategy_cases.case_names())
def test_strategy(transport, topology, case):
    results = outcomes(transport, topology)
    assert results[0]["__topology__"] == TOPOLOGIES[topology][3]
    assert all(r["__transport__"] == transport for r in results)
    if case.startswith("single_node"):  # on the ranks of one node, at least two of them
        assert len(results[0]["__single_node_ranks__"]) >= 2, results[0]["__single_node_ranks__"]
    failures = [f"rank {rank}:\n{r[case]}" for rank, r in enumerate(results) if r[case]]
    assert not failures, "\n".join(failures)


def single_node_on_two_nodes():
    try:
        dist.new_group([0, 1], backend="chainermn", pg_options=torch_chainermn.Options(communicator="single_node"))
    except ValueError as error:
        return str(error)
    return "created"


def options_from_environment():
    return torch_chainermn.get_options(), torch_chainermn.topology().inter_size


def options_and_single_node():
    return options_from_environment(), single_node_on_two_nodes()


@cached_launch
def two_node_job():
    """One 2-rank job (two nodes of one) for the two tests below: the default group's options come from
    the environment, and the explicit Options(communicator="single_node") overrides them (and is refused)."""
    return run_spawn(
        options_and_single_node,
        2,
        env={
            "CHAINERMN_RANKS_PER_NODE": "1",
            "CHAINERMN_COMMUNICATOR": "two_dimensional",
            "CHAINERMN_ALLREDUCE_GRAD_DTYPE": "bfloat16",
        },
    )


def test_single_node_refuses_several_nodes():
    messages = [single_node for _, single_node in two_node_job()]
    assert all("single_node" in m and "2 nodes" in m for m in messages), messages


def test_environment_chooses_the_communicator_without_code_changes():
    results = [options for options, _ in two_node_job()]
    assert results[0][0] == torch_chainermn.Options("two_dimensional", torch.bfloat16)
    assert results[0][1] == 2  # the communicator from the environment on two nodes


def test_options_are_validated():
    with pytest.raises(ValueError, match="hierarchical.*two_dimensional"):
        torch_chainermn.Options(communicator="ring")
    with pytest.raises(ValueError, match="float16"):
        torch_chainermn.Options(allreduce_grad_dtype=torch.int32)
    with pytest.raises(ValueError, match="allreduce_grad_dtype"):
        torch_chainermn.Options(allreduce_grad_dtype="int8")
    assert torch_chainermn.Options(allreduce_grad_dtype="half").allreduce_grad_dtype == torch.float16
