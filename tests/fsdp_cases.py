"""torch_chainermn.fsdp on real ranks: FSDP2 with two-hop collectives against FSDP2's own, same group."""
from __future__ import annotations

import torch
import torch.distributed as dist

import torch_chainermn
from torch_chainermn.fsdp import TwoHopAllGather, TwoHopReduceScatter

STEPS = 5


def make_model():
    torch.manual_seed(0)
    # 16 x 12 + 16 + 4 x 16 + 4 values: shards of uneven sizes across 4 ranks (FSDP pads them).
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def trained(two_hop: bool, reshard_after_forward=True, mixed=False) -> tuple[list, list]:
    """(the full parameters after STEPS of SGD, the FSDP modules' comm objects)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DeviceMesh

    rank = dist.get_rank()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    model = make_model()
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    modules = torch_chainermn.fsdp.two_hop(model) if two_hop else []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 12, generator=generator), torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    comms = [(group._reduce_scatter_comm, group._all_gather_comm)
             for m in modules for group in m._get_fsdp_state()._fsdp_param_groups]
    return [p.full_tensor().detach().float().clone() for p in model.parameters()], comms


def matches_fsdp2() -> dict:
    """Every configuration: the largest difference from FSDP2's own collectives, and whether the
    two hops ran (their buffers exist only once a two-hop call was made)."""
    two_nodes_of_many = torch_chainermn.topology().intra_size > 1
    out = {}
    for name, kwargs in (("plain", {}), ("hpZ", {"reshard_after_forward": 2}), ("bf16 params", {"mixed": True}),
                         ("no reshard", {"reshard_after_forward": False})):
        if name == "hpZ" and not two_nodes_of_many:
            continue
        expected, _ = trained(False, **kwargs)
        got, comms = trained(True, **kwargs)
        assert all(isinstance(rs, TwoHopReduceScatter) and isinstance(ag, TwoHopAllGather) for rs, ag in comms)
        out[name] = {"difference": max((a - b).abs().max().item() for a, b in zip(got, expected)),
                     "moved": max((a - b).abs().max().item() for a, b in zip(got, make_model().parameters())),
                     "two hops ran": all(rs._node_sums is not None and ag._across is not None for rs, ag in comms)}
    return out


def bad_input() -> list:
    errors = []
    for call in (lambda: torch_chainermn.fsdp.two_hop(make_model()),
                 lambda: _gloo_fsdp()):
        try:
            call()
            errors.append("")
        except ValueError as error:
            errors.append(str(error))
    return errors


def _gloo_fsdp():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DeviceMesh

    gloo = dist.new_group(backend="gloo")
    model = make_model()
    fully_shard(model, mesh=DeviceMesh.from_group(gloo, "cpu"))
    torch_chainermn.fsdp.two_hop(model)


def cases() -> dict:
    return {"configs": matches_fsdp2(), "errors": bad_input()}
