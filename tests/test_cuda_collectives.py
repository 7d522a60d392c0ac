"""Every collective and point-to-point op on CUDA tensors, checked against results computed on the CPU
(marked `cuda`: skipped without a GPU, see conftest.py).

The cases are tests/support/collective_cases.py's, built for the "cuda" device: the inputs are made on the GPU
and each result is compared with a reference computed on the CPU from every rank's input. Every
reduction is tried with every op; the combinations that must be refused are called anyway and must
raise their ValueError: AVG of bool, PREMUL_SUM of integers, bitwise ops of floats, and bitwise ops of
any CUDA tensor unless CUDA tensors are staged through the host library (NCCL has no bitwise
reductions). tests/test_collectives.py runs these same case sets on CPU tensors, so their
expectations are checked on machines without a GPU too.

One spawned job per configuration runs all the collectives and returns {case: None or traceback};
each case is then reported as its own test, as tests/test_collectives.py does. Point to point gets a
job of its own, so that a transfer failure (which makes the group unusable) cannot take the
collectives with it.
"""

import pytest
import torch

from tests.support import collective_cases
from tests.support.harness import cached_launch
from tests.test_cuda import config_names, cuda_configurations, run_cuda

pytestmark = pytest.mark.cuda

COLLECTIVES = collective_cases.device_collective_cases("cuda", collective_cases.NCCL_DTYPES)
POINT_TO_POINT = collective_cases.device_point_to_point_cases("cuda", collective_cases.NCCL_DTYPES)


def run_on_gpu(cases: dict) -> dict:
    import torch_chainermn

    torch.cuda.set_device(0)  # every rank shares the one GPU
    outcome = collective_cases.run_cases(cases=cases, trace=True)
    # Which CUDA transport the group really took: the expectations (bitwise refusals) depend on it.
    outcome["__cuda_transport__"] = torch_chainermn.get_options().cuda_transport
    return outcome


def collectives_job():
    return run_on_gpu(COLLECTIVES)


def point_to_point_job():
    return run_on_gpu(POINT_TO_POINT)


@cached_launch
def outcomes(config: str, job: str):
    """Every rank's outcome of one job, run once per configuration. A job that fails as a whole (a
    hang, a crash, any error) is remembered too, so each of its cases reports it without running it again."""
    fn = collectives_job if job == "collectives" else point_to_point_job
    return run_cuda(fn, 2, config, timeout=600, op_timeout=120)


def check_case(config: str, job: str, case: str) -> None:
    results = outcomes(config, job)  # the job's failure as a whole, raised again for each of its cases
    configured = cuda_configurations()[config][0]["CHAINERMN_CUDA_TRANSPORT"]
    assert all(r["__cuda_transport__"] == configured for r in results), [r["__cuda_transport__"] for r in results]
    failures = [f"rank {rank}:\n{r[case]}" for rank, r in enumerate(results) if r[case]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("config", config_names())
@pytest.mark.parametrize("case", list(COLLECTIVES))
def test_collective_on_cuda(config, case):
    check_case(config, "collectives", case)


@pytest.mark.parametrize("config", config_names())
@pytest.mark.parametrize("case", list(POINT_TO_POINT))
def test_point_to_point_on_cuda(config, case):
    check_case(config, "point_to_point", case)
