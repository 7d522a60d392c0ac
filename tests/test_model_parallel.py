"""MultiNodeChainList (ChainerMN's examples: split MLP, tuples, several rank_in/rank_out), pipelined
micro-batches (GPipe and 1F1B give the unpipelined gradients), the multi-node RNN, hybrid model and
data parallelism, and the forgotten delegate variable as an error instead of a hang. The checks run
in the jobs of model_parallel_cases.py (shared with test_functions.py)."""

import pytest

from tests.support.model_parallel_cases import assert_passed

CHAIN_CHECKS = [
    "split_mlp_training",
    "split_mlp_training_pipelined",
    "pipeline_schedules",
    "multi_node_rnn",
    "chain_errors",
]


@pytest.mark.parametrize("check", CHAIN_CHECKS)
def test_chain_over_gloo(check):
    for size in (2, 3, 4):
        assert_passed(f"chain[{size}]:{check}")


@pytest.mark.parametrize("check", ["graph_chain", "graph_chain_pipelined"])
def test_graph_chain_with_tuples_and_several_ranks(check):
    assert_passed(f"chain[3]:{check}")
    assert_passed(f"chain[4]:{check}")


def test_hybrid_model_and_data_parallel():
    assert_passed("world:hybrid_parallel")


def test_forgotten_delegate_is_an_error_not_a_hang():
    assert_passed("world:forgotten_delegate")
