"""torch_chainermn.fsdp: FSDP2 with two-hop reduce-scatter and all-gather (tests/support/fsdp_cases.py)."""

import tempfile

import pytest
import torch

from tests.support import fsdp_cases
from tests.support.harness import cached_launch, run_spawn
from torch_chainermn import fsdp


def language_model_then_cases(directory: str) -> tuple:
    """The LM's losses (first, in fresh processes, as on their own), then fsdp_cases.cases."""
    return fsdp_cases.lm_validation_losses(), fsdp_cases.cases(directory)


@cached_launch
def job(ranks_per_node: int) -> list:
    """Each rank's (LM losses or None, cases) on 2 nodes of `ranks_per_node`. 2 x 2 runs both tests'
    parts in one launch (4 processes start slowly on a 2-core machine)."""
    env = {"CHAINERMN_RANKS_PER_NODE": str(ranks_per_node)}
    with tempfile.TemporaryDirectory(prefix="chainermn-fsdp-dcp-") as directory:
        if ranks_per_node == 2:
            return run_spawn(language_model_then_cases, 4, env=env, timeout=600, directory=directory)
        outcomes = run_spawn(fsdp_cases.cases, 2 * ranks_per_node, env=env, timeout=300, directory=directory)
        return [(None, outcome) for outcome in outcomes]


@pytest.mark.parametrize("ranks_per_node", [2, 1])
def test_two_hops_equal_fsdp2(ranks_per_node):
    """2 nodes x 2 (two hops) and 2 x 1 (one hop between nodes): FSDP2's parameters after 5 steps
    to 1e-6, with hpZ (reshard_after_forward=2), bfloat16 parameters, no reshard; int8, 2-bit, 1-bit,
    4-bit and top-k gradients and int8 weights: the exchange equals the rules written plainly, residuals
    carried, training stays near FSDP2's with every rank alike, and a DCP checkpoint with the
    residuals resumes exactly; bad input raises."""
    outcomes = [cases for _, cases in job(ranks_per_node)]
    assert len(outcomes) == 2 * ranks_per_node
    for rank, outcome in enumerate(outcomes):
        configs = outcome["configs"]
        assert set(configs) >= {"plain", "bf16 params", "no reshard"} | ({"hpZ"} if ranks_per_node > 1 else set())
        for name, got in configs.items():
            assert got["moved"] > 1e-3, f"rank {rank}, {name}: did not train: {got}"
            assert got["difference"] < 1e-6, f"rank {rank}, {name}: {got}"
            assert got["two hops ran"] == (ranks_per_node > 1), f"rank {rank}, {name}: {got}"
        for code, training in outcome["training"].items():
            assert training["moved"] > 1e-3 and training["replicas agree"], f"rank {rank}, {code}: {training}"
            assert training["residuals kept"], f"rank {rank}, {code}: {training}"
        # int8 carries every gradient to within 1/254 of its block's largest; 2-bit at most +-t a value
        # and node per step, so it lags FSDP2 by design (its closeness is the LM benchmark's to judge).
        int8 = outcome["training"]["int8"]
        assert int8["difference"] < 2e-2, f"rank {rank}: int8 strayed from FSDP2's: {int8}"
        for code, exchange in outcome["exchange"].items():
            assert max(exchange.values()) < 1e-6, f"rank {rank}, {code}: {exchange}"
        checkpoint = outcome["checkpoint"]
        assert checkpoint["residuals"] == 2 and checkpoint["residuals carried"], f"rank {rank}: {checkpoint}"
        assert checkpoint["parameters equal"] and checkpoint["residuals equal"], f"rank {rank}: {checkpoint}"
        no_fsdp, not_chainermn, gradients, weights, block, threshold, state, result, both = outcome["errors"]
        assert f"gradients must be one of {fsdp.GRADIENTS}, got 'int4'" in gradients
        assert f"weights must be one of {fsdp.WEIGHTS}, got '2bit'" in weights
        assert "block must be >= 1, got 0" in block
        assert "threshold must be a positive finite number, got 0" in threshold  # the registry's rule (kernels/codes.h)
        assert "fsdp.load_state_dict: the state has residuals for ['0']" in state
        assert "compress_between_nodes: the model has no FSDP module" in no_fsdp
        assert "compress_between_nodes: the group does not use the chainermn backend (it uses gloo)" in not_chainermn
        assert "compress_result and result_dtype do not apply to FSDP2" in result
        assert "give compression= only (gradients= is its old spelling)" in both


@pytest.mark.parametrize("ranks_per_node", [2, 1])
def test_settings_that_differ_between_ranks_raise_on_every_rank(ranks_per_node):
    """compress_between_nodes with rank 0's threshold (old and new spelling), code, block, keep or
    weights code other than the other ranks': the same ValueError on every rank, naming the setting
    and each rank's value, before any gradient is coded (a differing threshold trained silently
    before). A bad argument on one rank raises on all, naming that rank."""
    op = "torch_chainermn.fsdp.compress_between_nodes"
    others = ",".join(str(r) for r in range(1, 2 * ranks_per_node))
    have = "have" if ranks_per_node > 1 else "has"
    expected = {
        "old spelling": "threshold: rank 0 has threshold=0.5; rank{s} {others} {have} threshold=0.25",
        "threshold": "threshold: rank 0 has threshold=0.5; rank{s} {others} {have} threshold=0.25",
        "code": "code: rank 0 has code='2bit'; rank{s} {others} {have} code='1bit'",
        "block": "block: rank 0 has block=256; rank{s} {others} {have} block=128",
        "keep": "keep: rank 0 has keep=8; rank{s} {others} {have} keep=4",
        "weights": "weights: rank 0 has weights='int8'; rank{s} {others} {have} weights='float32'",
        "object": "threshold: rank 0 has threshold=0.5; rank{s} {others} {have} threshold=0.25",
    }
    s = "s" if ranks_per_node > 1 else ""
    outcomes = [cases["differing"] for _, cases in job(ranks_per_node)]
    for rank, differing in enumerate(outcomes):
        assert differing == outcomes[0], f"rank {rank} raised otherwise than rank 0: {differing}"
        for setting, text in expected.items():
            message = f"{op}: the ranks differ in " + text.format(s=s, others=others, have=have)
            assert differing[setting] == message, f"rank {rank}, {setting}: {differing[setting]!r}"
        assert "block must be >= 1, got 0 (on rank 1)" in differing["refused"], differing["refused"]


def test_ddp_and_fsdp2_checkpoints_share_one_format():
    """One residual store, one checkpoint format (torch_chainermn/residuals.py): the same model and
    code under DDP (GradientCompressionState, parameters named) and FSDP2 give the same keys, the
    same settings and, per parameter name, float32 sums of the parameter's shape (FSDP2's a DTensor
    placed as the parameter, DDP's a plain tensor); each side's sums load into the other's."""
    for rank, (_, cases) in enumerate(job(1)):
        got = cases["one format"]
        ddp, fsdp2 = got["ddp"], got["fsdp2"]
        assert ddp["keys"] == fsdp2["keys"] == ["by_rank", "residuals", "settings"], (rank, got)
        assert ddp["settings"] == fsdp2["settings"], (rank, got)
        assert set(ddp["residuals"]) == set(fsdp2["residuals"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for name, (kind, shape, dtype) in ddp["residuals"].items():
            assert (kind, dtype) == ("Tensor", torch.float32), (rank, name, got)
            assert fsdp2["residuals"][name] == ("DTensor", shape, torch.float32), (rank, name, got)
        assert ddp["by_rank"] == ("dict", True) and fsdp2["by_rank"] == ("dict", True), (rank, got)
        assert got["owed"] and got["ddp into fsdp2"] and got["fsdp2 into ddp"], (rank, got)


def test_the_old_spelling_warns_at_the_caller():
    """gradients= (positional here) still works, with a DeprecationWarning naming compression= that
    points at the caller's line."""
    for rank, (_, cases) in enumerate(job(1)):
        assert cases["old spelling"] == [
            (
                "DeprecationWarning",
                "torch_chainermn.fsdp.compress_between_nodes: gradients= is deprecated, use "
                'compression= ({"code": code}, or None for "float32")',
                "fsdp_cases.py",
            )
        ], (rank, cases["old spelling"])


def test_language_model_with_codes_stays_near_fsdp2():
    """The cluster benchmark's LM task, CI-sized (2 nodes x 2 ranks, 40 AdamW steps): int8 gradients
    and weights end within 3% of FSDP2's validation loss. (2-bit and 1-bit gradients do not: with
    AdamW they end 10-15% above at every threshold tried, 1e-5 to 1e-2; docs/fsdp.md.)"""
    outcomes = [losses for losses, _ in job(2)]  # 4 ranks, CHAINERMN_RANKS_PER_NODE=2
    for rank, losses in enumerate(outcomes):
        assert losses["fsdp2"] < 4.0, f"rank {rank}: FSDP2 did not learn: {losses}"
        assert abs(losses["int8"] / losses["fsdp2"] - 1) < 0.03, f"rank {rank}: {losses}"
