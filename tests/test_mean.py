"""mean_coalesced: ChainerMN's gradient mean, packed in one pass with the cast to the wire dtype."""

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from tests.support.harness import run_mpiexec, run_spawn

SHAPES = [(3, 4), (0,), (), (1000,), (7, 1, 5)]


def gradients(rank, dtypes):
    """Deterministic per-rank values; every rank can rebuild every other rank's."""
    torch.manual_seed(100 + rank)
    return [torch.randn(shape, dtype=torch.float64).to(dtype) for shape, dtype in zip(SHAPES, dtypes)]


def expected_mean(size, dtypes):
    per_rank = [gradients(r, dtypes) for r in range(size)]
    return [torch.stack([g[i].double() for g in per_rank]).mean(0) for i in range(len(SHAPES))]


def check_mean(wire, dtypes, tolerance):
    rank, size = dist.get_rank(), dist.get_world_size()
    tensors = gradients(rank, dtypes)
    torch_chainermn.mean_coalesced(tensors, dtype=wire)
    for tensor, want, dtype in zip(tensors, expected_mean(size, dtypes), dtypes):
        assert tensor.dtype == dtype
        torch.testing.assert_close(tensor.double(), want, rtol=tolerance, atol=tolerance)


def mean_cases():
    rank = dist.get_rank()
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    check_mean(None, [f32] * 5, 1e-6)
    check_mean(torch.float16, [f32] * 5, 2e-3)  # fp16 on the wire: within fp16's error
    check_mean(torch.bfloat16, [f32] * 5, 2e-2)
    check_mean(None, [f16, f32, f16, f32, bf16], 5e-3)  # mixed: travels as float32, the widest
    check_mean(torch.float64, [f32, f16, f32, f32, f32], 5e-3)

    # No overflow where the mean fits: 60000 on every rank sums past float16's 65504.
    big = torch.full((8,), 60000.0, dtype=torch.float16)
    torch_chainermn.mean_coalesced([big], dtype=torch.float16)
    assert torch.isfinite(big).all() and abs(big[0].item() - 60000.0) < 64, big

    # Async, and the packing buffer stops growing once warmed up.
    backend = torch_chainermn._backend.backend_of()
    work = torch_chainermn.mean_coalesced(gradients(rank, [f32] * 5), dtype=torch.float16, async_op=True)
    work.wait()
    held = backend.scratch_bytes()
    for _ in range(3):
        torch_chainermn.mean_coalesced(gradients(rank, [f32] * 5), dtype=torch.float16)
    assert backend.scratch_bytes() == held

    for bad, words in [
        (lambda: torch_chainermn.mean_coalesced([torch.ones(2, dtype=torch.int64)]), "floating"),
        (lambda: torch_chainermn.mean_coalesced([torch.ones(2)], dtype=torch.int32), "allreduce_grad_dtype"),
    ]:
        with pytest.raises(ValueError, match=words):
            bad()
    return True


def group_default_wire_dtype():
    group = dist.new_group(backend="chainermn", pg_options=torch_chainermn.Options(allreduce_grad_dtype="float16"))
    rank = dist.get_rank()
    tensor = torch.full((4,), 1.0 / 3.0 + rank)
    torch_chainermn.mean_coalesced([tensor], group=group)
    # A third is not exact in float16: the group's wire dtype was used.
    return tensor[0].item()


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_mean_over_gloo(shm):
    assert run_spawn(mean_cases, 3, env={"CHAINERMN_SHM": shm, "CHAINERMN_RANKS_PER_NODE": "2"}) == [True] * 3


@pytest.mark.mpi
def test_mean_over_mpi():
    assert run_mpiexec(mean_cases, 3, env={"CHAINERMN_RANKS_PER_NODE": "2"}) == [True] * 3


def test_group_wire_dtype_is_the_default():
    values = run_spawn(group_default_wire_dtype, 2)
    exact = 1.0 / 3.0 + 0.5
    assert values[0] == values[1] and values[0] != pytest.approx(exact, abs=1e-7)
    assert values[0] == pytest.approx(exact, abs=2e-3)


def float16_casts():
    """On one rank the mean is the casts alone: float32 through a float16 wire must come back exactly
    as torch's `.half().float()`, and float16 through a float32 wire unchanged, bit for bit (the CPU
    casts use F16C where the CPU has it: the tails of lengths not a multiple of 8 go one by one)."""
    torch.manual_seed(7)
    values = torch.cat(
        [
            torch.randn(1003) * 1000,
            torch.randn(13) * 1e-6,  # subnormal in float16
            torch.tensor([70000.0, -70000.0, 65504.0, 0.0, -0.0, 1e-8, 2.0**-24]),
        ]
    )
    via_half = values.clone()
    torch_chainermn.mean_coalesced([via_half], dtype=torch.float16)
    halves = values.half()
    via_float = halves.clone()
    torch_chainermn.mean_coalesced([via_float], dtype=torch.float32)
    return torch.equal(via_half, values.half().float()), torch.equal(via_float, halves)


def test_float16_casts_are_exact():
    assert run_spawn(float16_casts, 1) == [(True, True)]
