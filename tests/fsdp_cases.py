"""torch_chainermn.fsdp on real ranks: FSDP2 with two-hop collectives against FSDP2's own, same group."""
from __future__ import annotations

import torch
import torch.distributed as dist

import torch_chainermn
from tests.collective_cases import value_errors
from torch_chainermn.fsdp import TwoHopAllGather, TwoHopReduceScatter

STEPS = 5


def make_model():
    torch.manual_seed(0)
    # 16 x 12 + 16 + 4 x 16 + 4 values: shards of uneven sizes across 4 ranks (FSDP pads them).
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def trained(two_hop: bool, reshard_after_forward=True, mixed=False, int8=False) -> tuple[list, list]:
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
    modules = (torch_chainermn.fsdp.compress_between_nodes(model, "int8", "int8", block=8) if int8
               else torch_chainermn.fsdp.two_hop(model) if two_hop else [])
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


def int8_training() -> dict:
    """int8 gradients and weights between nodes: how far from FSDP2's own (quantisation error, not
    a wrong result), and whether every rank holds the same parameters."""
    expected, _ = trained(False)
    got, comms = trained(True, int8=True)
    mine = torch.cat([p.reshape(-1) for p in got])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return {"difference": max((a - b).abs().max().item() for a, b in zip(got, expected)),
            "moved": max((a - b).abs().max().item() for a, b in zip(got, make_model().parameters())),
            "replicas agree": all(torch.equal(e, everyone[0]) for e in everyone),
            "residuals kept": all(rs._residual is not None and rs._residual.abs().sum() > 0 for rs, _ in comms)}


def quantized(values: torch.Tensor, block: int) -> torch.Tensor:
    """What int8 block codes carry, block by block, written plainly (torch_chainermn/fsdp/int8.py's rule)."""
    out = torch.zeros_like(values)
    for row in range(values.shape[0]):
        for start in range(0, values.shape[1], block):
            piece = values[row, start:start + block]
            scale = piece.abs().max() / 127.0
            if scale > 0:
                out[row, start:start + block] = torch.round(piece / scale).clamp(-127, 127) * scale
    return out


def int8_exchange_matches_reference() -> dict:
    """The comm objects alone, 3 calls: the int8 reduce-scatter (residuals carried from call to call)
    and all-gather against the rules written plainly, every rank's inputs known to every rank."""
    from torch_chainermn.fsdp.int8 import padded

    rank, world = dist.get_rank(), dist.get_world_size()
    topo = torch_chainermn.topology()
    rank_at = [list(topo.ranks_of_node[n]) for n in range(topo.inter_size)]
    nodes, per_node = len(rank_at), len(rank_at[0])
    node, intra = topo.node_of_rank[rank], topo.intra_rank
    shard, block = 10, 4
    width = padded(shard, block)

    def gradients(step, r):
        return torch.randn(world * shard, generator=torch.Generator().manual_seed(100 * step + r))

    reduce_scatter, all_gather = TwoHopReduceScatter("int8", block), TwoHopAllGather("int8", block)
    residual = {(n, l): torch.zeros(nodes, width) for n in range(nodes) for l in range(per_node)}
    worst = {"reduce-scatter": 0.0, "all-gather": 0.0}
    for step in range(3):
        got = torch.empty(shard)
        reduce_scatter(got, gradients(step, rank), dist.group.WORLD, op=dist.ReduceOp.SUM)
        sent = {}
        for n in range(nodes):
            node_sum = sum(gradients(step, r) for r in rank_at[n]).view(world, shard)
            for l in range(per_node):
                values = residual[(n, l)].clone()
                for m in range(nodes):
                    values[m, :shard] += node_sum[rank_at[m][l]]
                sent[(n, l)] = quantized(values, block)
                residual[(n, l)] = values - sent[(n, l)]
        expected = sum(sent[(n, intra)][node, :shard] for n in range(nodes))
        worst["reduce-scatter"] = max(worst["reduce-scatter"], (got - expected).abs().max().item())

        weights = [torch.randn(shard, generator=torch.Generator().manual_seed(7000 + 100 * step + r))
                   for r in range(world)]
        gathered = torch.empty(world * shard)
        all_gather(gathered, weights[rank], dist.group.WORLD)
        expected = torch.cat([quantized(torch.nn.functional.pad(w, (0, width - shard))[None], block)[0, :shard]
                              for w in weights])
        worst["all-gather"] = max(worst["all-gather"], (gathered - expected).abs().max().item())
    return worst


def bad_input() -> list:
    def sharded():
        from torch.distributed.fsdp import fully_shard
        return fully_shard(make_model())

    return value_errors([lambda: torch_chainermn.fsdp.two_hop(make_model()),
                         lambda: _gloo_fsdp(),
                         lambda: torch_chainermn.fsdp.compress_between_nodes(sharded(), gradients="int4"),
                         lambda: torch_chainermn.fsdp.compress_between_nodes(sharded(), weights="2bit"),
                         lambda: torch_chainermn.fsdp.compress_between_nodes(sharded(), block=0)])


def _gloo_fsdp():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DeviceMesh

    gloo = dist.new_group(backend="gloo")
    model = make_model()
    fully_shard(model, mesh=DeviceMesh.from_group(gloo, "cpu"))
    torch_chainermn.fsdp.two_hop(model)


def cases() -> dict:
    return {"configs": matches_fsdp2(), "int8 training": int8_training(),
            "int8 exchange": int8_exchange_matches_reference(), "errors": bad_input()}
