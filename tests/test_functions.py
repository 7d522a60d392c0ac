"""chainermn.functions on torch autograd: send/recv with delegate variables, pseudo_connect, and the
differentiable collectives, each against the same computation on one process (float64), on
communicators of 2, 3 and 4 ranks over Gloo and of 2 ranks over MPI. One job per transport runs all
the checks (model_parallel_cases.py); each test asserts on its part of the report."""
import pytest

from tests.model_parallel_cases import assert_passed

CHECKS = ["send_recv_chain", "seed_delegate_variable", "seed_two_sends_pseudo_connect", "pseudo_connect_alone",
          "bcast", "gather", "scatter", "allgather", "ensemble_allgather", "alltoall", "function_errors"]


@pytest.mark.parametrize("check", CHECKS)
def test_functions_over_gloo(check):
    assert_passed("gloo", f"functions[2]:{check}")
    assert_passed("gloo", f"functions[3]:{check}")
    assert_passed("gloo", f"functions[4]:{check}")


@pytest.mark.mpi
def test_functions_over_mpi():
    for check in CHECKS:
        assert_passed("mpi", f"functions[2]:{check}")
