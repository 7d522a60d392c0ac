"""chainermn.functions on torch autograd: send/recv with delegate variables, pseudo_connect, and the
differentiable collectives, each against the same computation on one process (float64), on
communicators of 2, 3 and 4 ranks. One 4-rank job (Gloo) runs all the checks of this file and of
test_model_parallel.py (model_parallel_cases.py); each test asserts on its part of the report. MPI:
the model-parallel example runs under mpiexec in test_examples_model_parallel.py."""

import pytest

from tests.support.model_parallel_cases import assert_passed

CHECKS = [
    "send_recv_chain",
    "seed_delegate_variable",
    "seed_two_sends_pseudo_connect",
    "pseudo_connect_alone",
    "bcast",
    "gather",
    "scatter",
    "allgather",
    "ensemble_allgather",
    "alltoall",
    "function_errors",
]


@pytest.mark.parametrize("check", CHECKS)
def test_functions_over_gloo(check):
    assert_passed(f"functions[2]:{check}")
    assert_passed(f"functions[3]:{check}")
    assert_passed(f"functions[4]:{check}")


@pytest.mark.cuda
def test_model_parallel_on_cuda():
    from tests.support.model_parallel_cases import cuda_checks
    from tests.test_cuda import run_cuda

    assert run_cuda(cuda_checks, 2, "nccl", timeout=300, op_timeout=120) == [True, True]
