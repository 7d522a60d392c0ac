"""Torch's own DDP communication hooks on CUDA tensors train on chainermn what they train on torch's
nccl (marked `cuda`: skipped without a GPU, see conftest.py).

tests/test_torch_hooks.py does this on the CPU against gloo; here the same training (same model,
data, hooks and states, tests/test_torch_hooks.py's `train`) runs on the GPU in the same two
processes, once on the chainermn default group and once on a torch nccl group, and the parameters
are compared. Both ranks share the one GPU, so torch's nccl groups need a distinct NCCL_HOSTID per
rank in every configuration (run_cuda's nccl_reference).

On CUDA the hooks' then() callbacks read the reduced bucket on the stream their future hands them:
a future that did not order that stream after the backend's would read the bucket before the
reduction lands, and the parameters would differ from nccl's.
"""

import traceback

import pytest
import torch
import torch.distributed as dist

from tests.test_cuda import config_names, run_cuda
from tests.test_torch_hooks import flat, small_model, train
from tests.support.training_reference import make_model

pytestmark = pytest.mark.cuda

# (what is reported, torch's hook, the model): every torch hook, bf16 included (DDP refuses it on the
# CPU without NCCL), then PowerSGD with two buckets whose callbacks wait for collectives at the same
# time (gloo deadlocks there on the CPU, so tests/test_torch_hooks.py only checks that the replicas
# agree). batched_powerSGD last: torch 2.13's own _orthogonalize refuses the 2-D matrix that hook
# builds, and a hook that raises leaves its step half done.
RUNS = [
    (name, name, small_model)
    for name in ("allreduce", "fp16_compress", "bf16_compress", "fp16_compress_wrapper", "powerSGD", "post_localSGD")
]
RUNS += [("powerSGD (several buckets)", "powerSGD", make_model), ("batched_powerSGD", "batched_powerSGD", small_model)]


def outcome_of(name: str, group, subgroup, make):
    """("trained", the parameters on the CPU, "") or ("raised", the exception's type, its traceback)."""
    try:
        return "trained", train(name, group, subgroup, make=make, device="cuda").cpu(), ""
    except Exception as error:  # noqa: BLE001  compared with what nccl does with the same hook
        return "raised", type(error).__name__, traceback.format_exc()


def hooks_against_nccl():
    """For every run, chainermn's outcome and nccl's."""
    torch.cuda.set_device(0)
    nccl = dist.new_group(backend="nccl")
    # Local SGD averages within a subgroup: one per simulated node, on each backend.
    ours_sub, _ = dist.new_subgroups(group_size=1)
    nccl_sub, _ = dist.new_subgroups(group_size=1, backend="nccl")
    return {
        label: (outcome_of(name, None, ours_sub, make), outcome_of(name, nccl, nccl_sub, make))
        for label, name, make in RUNS
    }


# Both runs do the same float math on the same GPU; only the order of a two-term sum could differ.
TOLERANCE = 1e-5


def failures_against_reference(outcomes) -> list:
    """What went wrong, per rank and run, in hooks_against_nccl's outcomes."""
    start = {label: flat(make()) for label, _, make in RUNS}
    failures = []
    for rank, outcome in enumerate(outcomes):
        for label, ((our_kind, ours, our_trace), (their_kind, theirs, their_trace)) in outcome.items():
            what = f"rank {rank} {label}"
            if their_kind == "raised":
                # torch's own hook fails on nccl too (batched_powerSGD on torch 2.13): chainermn must
                # fail the same way, not train something else.
                if (our_kind, ours) != (their_kind, theirs):
                    failures.append(f"{what}: nccl raised {theirs}, chainermn {our_kind} {our_trace}\n{their_trace}")
            elif our_kind == "raised":
                failures.append(f"{what}: chainermn raised where nccl trained:\n{our_trace}")
            else:
                difference = (ours - theirs).abs().max().item()
                if difference > TOLERANCE:
                    failures.append(f"{what}: parameters differ from nccl's by {difference}")
                if torch.equal(ours, start[label]):
                    failures.append(f"{what}: training did not change the model")
    return failures


@pytest.mark.parametrize("config", config_names())
def test_torch_hooks_match_nccl(config):
    outcomes = run_cuda(hooks_against_nccl, 2, config, nccl_reference=True, timeout=600, op_timeout=120)
    failures = failures_against_reference(outcomes)
    assert not failures, "\n".join(failures)
