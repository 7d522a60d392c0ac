"""CUDA tensors on a GPU machine. This build handles CPU tensors; CUDA ones must be refused cleanly."""
import pytest
import torch
import torch.distributed as dist

from tests.harness import run_spawn


def cuda_tensor_is_refused():
    tensor = torch.ones(4, device="cuda")
    try:
        dist.all_reduce(tensor)
    except ValueError as error:
        message = str(error)
    else:
        message = "accepted"
    check = torch.ones(2)
    dist.all_reduce(check)  # the group is still usable
    return message, check.tolist()


@pytest.mark.cuda
def test_cuda_tensor_gets_a_clear_error():
    outcomes = run_spawn(cuda_tensor_is_refused, 2)
    for message, check in outcomes:
        assert "all_reduce" in message and "cuda" in message, message
        assert check == [2.0, 2.0]
