"""torch's own parallelism on CUDA tensors gives on a chainermn group what it gives on torch's nccl:
FSDP2 (`fully_shard`), ZeroRedundancyOptimizer under DDP, and distributed checkpointing; DiLoCo and
torch_chainermn.fsdp's coded exchange on the GPU what they give on the CPU (marked `cuda`: skipped without a GPU,
see conftest.py).

tests/test_torch_parallel.py does this on the CPU against gloo; here its same functions run with the
model on the GPU. One 2-rank job per configuration trains on a chainermn group and on a torch nccl
group (same processes, same data) and returns both results. Both ranks share the one GPU, so the
nccl group needs a distinct NCCL_HOSTID per rank in every configuration (run_cuda's nccl_reference).

FSDP2 issues its all-gathers and reduce-scatters (ReduceOp.AVG) from streams of its own and waits
for them through the Work: a backend that did not order its work after the caller's stream, or the
caller's stream after its work, would read or write those buffers too early.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.support import fsdp_cases, local_sgd_cases
from tests.support.harness import cached_launch
from tests.test_cuda import config_names, run_cuda
from tests.test_torch_parallel import checkpoint, fsdp2, make_model, zero

pytestmark = pytest.mark.cuda


def both_backends(directory):
    torch.cuda.set_device(0)  # every rank shares the one GPU
    rank = dist.get_rank()
    results = {}
    for backend in ("chainermn", "nccl"):
        group = dist.new_group([0, 1], backend=backend)
        results[backend] = {
            "fsdp2": fsdp2(group, rank, "cuda"),
            "zero": zero(group, rank, "cuda"),
            "checkpoint": checkpoint(group, rank, f"{directory}/{backend}", "cuda"),
        }
    return results


@cached_launch
def results_of(config: str):
    """Every rank's results, run once per configuration; a job that fails as a whole (any error) is
    remembered too, so the next test reports it without running it again."""
    with tempfile.TemporaryDirectory(prefix="chainermn-dcp-cuda-") as directory:
        return run_cuda(both_backends, 2, config, directory=directory, nccl_reference=True, timeout=300, op_timeout=120)


@pytest.mark.parametrize("config", config_names())
@pytest.mark.parametrize("what", ["fsdp2", "zero"])
def test_training_on_cuda_matches_nccl(config, what):
    for rank, result in enumerate(results_of(config)):
        ours, theirs = result["chainermn"][what], result["nccl"][what]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            # The same kernels on the same GPU; the reductions are two-term sums (and halvings).
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{what} on rank {rank}")
        start = [p.detach() for p in make_model().parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(ours, start)), f"{what} did not train"


@pytest.mark.parametrize("config", config_names())
def test_distributed_checkpoint_on_cuda_saves_and_loads(config):
    for result in results_of(config):
        assert result["chainermn"]["checkpoint"] is True
        assert result["nccl"]["checkpoint"] is True


@pytest.mark.parametrize("config", config_names())
def test_diloco_on_cuda_matches_cpu(config):
    """Streaming DiLoCo, 2 ranks as 2 nodes (so 2-bit compresses between them): the GPU trajectory
    is the CPU one up to float rounding (float32), and up to a few flipped 2-bit codes (t / 2 each)."""
    results = run_cuda(
        local_sgd_cases.cuda_matches_cpu,
        2,
        config,
        extra_env={"CHAINERMN_RANKS_PER_NODE": "1"},
        timeout=240,
        op_timeout=120,
    )
    for rank, outcome in enumerate(results):
        assert outcome["float32"]["moved"] > 1e-2 and outcome["2bit"]["moved"] > 1e-2, outcome
        assert outcome["float32"]["difference"] < 1e-4, f"rank {rank}: {outcome}"
        assert outcome["2bit"]["difference"] < 4 * local_sgd_cases.THRESHOLD, f"rank {rank}: {outcome}"


@pytest.mark.parametrize("config", config_names())
def test_fsdp_codes_between_nodes_on_cuda(config):
    """torch_chainermn.fsdp's coded reduce-scatter (int8, 2-bit, 1-bit, residuals carried over 3
    calls) and int8 all-gather on CUDA tensors, 2 ranks as 2 nodes: the rules written plainly (1-bit's
    scale, summed on the GPU in another order, to float rounding)."""
    results = run_cuda(
        fsdp_cases.cuda_cases, 2, config, extra_env={"CHAINERMN_RANKS_PER_NODE": "1"}, timeout=240, op_timeout=120
    )
    for rank, outcome in enumerate(results):
        for code, worst in outcome.items():
            assert max(worst.values()) < (1e-5 if code == "1bit" else 1e-6), f"rank {rank}, {code}: {worst}"
