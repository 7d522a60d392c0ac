"""torch_chainermn.fsdp: FSDP2 with two-hop reduce-scatter and all-gather (tests/fsdp_cases.py)."""
import pytest

from tests import fsdp_cases
from tests.harness import run_spawn


@pytest.mark.parametrize("ranks_per_node", [2, 1])
def test_two_hops_equal_fsdp2(ranks_per_node):
    """2 nodes x 2 (two hops) and 2 x 1 (one hop between nodes): FSDP2's parameters after 5 steps
    to 1e-6, with hpZ (reshard_after_forward=2), bfloat16 parameters, no reshard; int8 gradients and
    weights: the exchange equals the rules written plainly, residuals carried, and training stays
    near FSDP2's with every rank alike; bad input raises."""
    world = 2 * ranks_per_node
    outcomes = run_spawn(fsdp_cases.cases, world, env={"CHAINERMN_RANKS_PER_NODE": str(ranks_per_node)},
                         timeout=300)
    for rank, outcome in enumerate(outcomes):
        configs = outcome["configs"]
        assert set(configs) >= {"plain", "bf16 params", "no reshard"} | ({"hpZ"} if ranks_per_node > 1 else set())
        for name, got in configs.items():
            assert got["moved"] > 1e-3, f"rank {rank}, {name}: did not train: {got}"
            assert got["difference"] < 1e-6, f"rank {rank}, {name}: {got}"
            assert got["two hops ran"] == (ranks_per_node > 1), f"rank {rank}, {name}: {got}"
        training = outcome["int8 training"]
        assert training["moved"] > 1e-3 and training["replicas agree"], f"rank {rank}: {training}"
        assert training["difference"] < 2e-2, f"rank {rank}: int8 strayed from FSDP2's: {training}"
        assert training["residuals kept"], f"rank {rank}: {training}"
        exchange = outcome["int8 exchange"]
        assert exchange["reduce-scatter"] < 1e-6 and exchange["all-gather"] < 1e-6, f"rank {rank}: {exchange}"
        no_fsdp, not_chainermn, gradients, weights, block = outcome["errors"]
        assert "gradients must be one of ('float32', 'int8'), got 'int4'" in gradients
        assert "weights must be one of ('float32', 'int8'), got '2bit'" in weights
        assert "block must be an int >= 1, got 0" in block
        assert "compress_between_nodes: the model has no FSDP module" in no_fsdp
        assert "compress_between_nodes: the group does not use the chainermn backend (it uses gloo)" in not_chainermn
