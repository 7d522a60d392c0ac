"""torch_chainermn.fsdp on real ranks: FSDP2 with two-hop collectives against FSDP2's own, same group."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import torch_chainermn
from tests.support import compression_reference
from tests.support.collective_cases import value_errors
from torch_chainermn.fsdp import TwoHopAllGather, TwoHopReduceScatter

STEPS = 5
THRESHOLD = 0.02  # 2-bit: about a tenth of the test model's gradients


def make_model():
    torch.manual_seed(0)
    # 16 x 12 + 16 + 4 x 16 + 4 values: shards of uneven sizes across 4 ranks (FSDP pads them).
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def sharded_model(reshard_after_forward=True, mixed=False, device="cpu"):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, device)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    model = make_model().to(device)
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def train(model, optimizer, steps, first_step=0, device="cpu"):
    """`steps` steps of MSE on data drawn from the rank and the step's index (so a resumed run sees
    the same data as an unbroken one)."""
    for step in range(first_step, first_step + steps):
        generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(8, 12, generator=generator), torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        optimizer.step()


def trained(two_hop: bool, reshard_after_forward=True, mixed=False, codes=None, device="cpu") -> tuple[list, list]:
    """(the full parameters after STEPS of SGD, the FSDP modules' comm objects). codes: (gradients,
    weights) between nodes, else two hops at full precision (two_hop) or FSDP2's own collectives."""
    model = sharded_model(reshard_after_forward, mixed, device)
    modules = (
        torch_chainermn.fsdp.compress_between_nodes(
            model, compression={"code": codes[0]}, weights=codes[1], block=8, threshold=THRESHOLD
        )
        if codes
        else torch_chainermn.fsdp.two_hop(model)
        if two_hop
        else []
    )
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), STEPS, device=device)
    comms = [
        (group._reduce_scatter_comm, group._all_gather_comm)
        for m in modules
        for group in m._get_fsdp_state()._fsdp_param_groups
    ]
    return [p.full_tensor().detach().float().cpu().clone() for p in model.parameters()], comms


def matches_fsdp2() -> dict:
    """Every configuration: the largest difference from FSDP2's own collectives, and whether the
    two hops ran (their buffers exist only once a two-hop call was made)."""
    two_nodes_of_many = torch_chainermn.topology().intra_size > 1
    out = {}
    for name, kwargs in (
        ("plain", {}),
        ("hpZ", {"reshard_after_forward": 2}),
        ("bf16 params", {"mixed": True}),
        ("no reshard", {"reshard_after_forward": False}),
    ):
        if name == "hpZ" and not two_nodes_of_many:
            continue
        expected, _ = trained(False, **kwargs)
        got, comms = trained(True, **kwargs)
        assert all(isinstance(rs, TwoHopReduceScatter) and isinstance(ag, TwoHopAllGather) for rs, ag in comms)
        out[name] = {
            "difference": max((a - b).abs().max().item() for a, b in zip(got, expected)),
            "moved": max((a - b).abs().max().item() for a, b in zip(got, make_model().parameters())),
            "two hops ran": all(rs._node_sums is not None and ag._across is not None for rs, ag in comms),
        }
    return out


def coded_training(gradients: str, weights: str = "int8") -> dict:
    """Coded gradients and weights between nodes: how far from FSDP2's own (the codes' error, not a
    wrong result), and whether every rank holds the same parameters."""
    expected, _ = trained(False)
    got, comms = trained(True, codes=(gradients, weights))
    mine = torch.cat([p.reshape(-1) for p in got])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return {
        "difference": max((a - b).abs().max().item() for a, b in zip(got, expected)),
        "moved": max((a - b).abs().max().item() for a, b in zip(got, make_model().parameters())),
        "replicas agree": all(torch.equal(e, everyone[0]) for e in everyone),
        "residuals kept": all(rs.residual is not None and rs.residual.abs().sum() > 0 for rs, _ in comms),
    }


def quantized(values: torch.Tensor, block: int) -> torch.Tensor:
    """What int8 block codes carry, block by block, written plainly (csrc/kernels/int8.h's rule)."""
    out = torch.zeros_like(values)
    for row in range(values.shape[0]):
        for start in range(0, values.shape[1], block):
            piece = values[row, start : start + block]
            largest = piece.abs().max()
            if largest > 0:
                codes = torch.round(piece * (127.0 / largest)).clamp(-127, 127)
                out[row, start : start + block] = codes * (largest / 127.0)
    return out


def carried(code: str, rows: torch.Tensor, block: int, threshold: float, keep: int) -> torch.Tensor:
    """What each row's code carries (int8: quantized; the others: tests/compression_reference)."""
    if code == "int8":
        return quantized(rows, block)
    return torch.stack(
        [compression_reference.quantize(code, row, None, row.numel(), threshold, block, keep)[2] for row in rows]
    )


def coded_exchange_matches_reference(code: str, device="cpu") -> dict:
    """The comm objects alone, 3 calls: the coded reduce-scatter (residuals carried from call to
    call) and the int8 all-gather against the rules written plainly, every rank's inputs known to
    every rank; the largest difference of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = torch_chainermn.topology()
    rank_at = [list(topo.ranks_of_node[n]) for n in range(topo.inter_size)]
    nodes, per_node = len(rank_at), len(rank_at[0])
    node, intra = topo.node_of_rank[rank], topo.intra_rank
    shard, block, threshold, keep = 10, 4, 0.5, 2

    def gradients(step, r):
        return torch.randn(world * shard, generator=torch.Generator().manual_seed(100 * step + r))

    # The weights in the same code where it can carry them (fsdp.WEIGHTS), else int8.
    weights_code = code if code in torch_chainermn.fsdp.WEIGHTS else "int8"
    reduce_scatter, all_gather = TwoHopReduceScatter(code, block, threshold, keep), TwoHopAllGather(weights_code, block)
    residual = {(n, l): torch.zeros(nodes, shard) for n in range(nodes) for l in range(per_node)}
    worst = {"reduce-scatter": 0.0, "all-gather": 0.0}
    for step in range(3):
        got = torch.empty(shard, device=device)
        reduce_scatter(got, gradients(step, rank).to(device), dist.group.WORLD, op=dist.ReduceOp.SUM)
        sent = {}
        for n in range(nodes):
            node_sum = sum(gradients(step, r) for r in rank_at[n]).view(world, shard)
            for l in range(per_node):
                values = residual[(n, l)].clone()
                for m in range(nodes):
                    values[m] += node_sum[rank_at[m][l]]
                sent[(n, l)] = carried(code, values, block, threshold, keep)
                residual[(n, l)] = values - sent[(n, l)]
        expected = sum(sent[(n, intra)][node] for n in range(nodes))
        worst["reduce-scatter"] = max(worst["reduce-scatter"], (got.cpu() - expected).abs().max().item())

        weights = [
            torch.randn(shard, generator=torch.Generator().manual_seed(7000 + 100 * step + r)) for r in range(world)
        ]
        gathered = torch.empty(world * shard, device=device)
        all_gather(gathered, weights[rank].to(device), dist.group.WORLD)
        expected = torch.cat([carried(weights_code, w[None], block, threshold, keep)[0] for w in weights])
        worst["all-gather"] = max(worst["all-gather"], (gathered.cpu() - expected).abs().max().item())
    worst["residual"] = (reduce_scatter.residual.cpu() - residual[(node, intra)]).abs().max().item()
    return worst


def checkpoint_resumes_exactly(directory: str, gradients: str = "2bit") -> dict:
    """3 steps, a DCP checkpoint of the model, the optimizer and the residuals, 2 steps more; then a
    fresh model loads the checkpoint and takes the same 2 steps: the parameters and the residuals
    must be equal, and the residuals must not be zero (they were carried). The root holds no
    parameters of its own: 2 residuals, the Linear layers'."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def run():
        model = sharded_model()
        torch_chainermn.fsdp.compress_between_nodes(
            model, compression={"code": gradients, "block": 8, "threshold": THRESHOLD}, weights="int8"
        )
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def state_of(model, optimizer):
        return {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
            "residuals": torch_chainermn.fsdp.state_dict(model),
        }

    def finished(model):
        residuals = torch_chainermn.fsdp.state_dict(model)["by_rank"]  # each rank's own, per module
        return (
            [p.full_tensor().detach().clone() for p in model.parameters()],
            [residuals[k].to_local().clone() for k in sorted(residuals)],
        )

    model, optimizer = run()
    train(model, optimizer, 3)
    dcp.save(state_of(model, optimizer), checkpoint_id=directory)
    train(model, optimizer, 2, first_step=3)
    unbroken = finished(model)

    model, optimizer = run()
    state = state_of(model, optimizer)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    torch_chainermn.fsdp.load_state_dict(model, state["residuals"])
    train(model, optimizer, 2, first_step=3)
    resumed = finished(model)
    return {
        "parameters equal": all(torch.equal(a, b) for a, b in zip(unbroken[0], resumed[0])),
        "residuals equal": all(torch.equal(a, b) for a, b in zip(unbroken[1], resumed[1])),
        "residuals": len(unbroken[1]),
        "residuals carried": all(r.abs().sum() > 0 for r in unbroken[1]),
    }


def one_format() -> dict:
    """The same model and code under DDP (a GradientCompressionState, its parameters named) and under
    FSDP2 (compress_between_nodes), 2 steps each: each checkpoint's keys and value kinds; then each
    side's sums loaded into the other side's fresh residuals and saved again, to equal them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    settings = {"code": "2bit", "threshold": THRESHOLD, "block": 8}

    def kinds(state) -> dict:
        return {
            "keys": sorted(state),
            "settings": state["settings"],
            "residuals": {
                name: (type(value).__name__, tuple(value.shape), value.dtype)
                for name, value in state["residuals"].items()
            },
            "by_rank": (type(state["by_rank"]).__name__, all(isinstance(k, str) for k in state["by_rank"])),
        }

    def ddp_side():
        model = DDP(make_model())
        state = torch_chainermn.hooks.GradientCompressionState(**settings)
        state.name_parameters(model)
        model.register_comm_hook(state, torch_chainermn.hooks.gradient_compression_hook)
        return model, state

    def fsdp_side():
        model = sharded_model()
        torch_chainermn.fsdp.compress_between_nodes(model, compression=dict(settings), weights="float32")
        return model

    model, ddp = ddp_side()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    ddp_state = ddp.state_dict(by_rank=True)
    model = fsdp_side()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    fsdp_state = torch_chainermn.fsdp.state_dict(model)

    def full(value):
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    # DDP's sums into a fresh FSDP2 model, FSDP2's into a fresh DDP state: the same sums come back.
    into_fsdp = fsdp_side()
    torch_chainermn.fsdp.load_state_dict(into_fsdp, {k: ddp_state[k] for k in ("settings", "residuals")})
    back_from_fsdp = torch_chainermn.fsdp.state_dict(into_fsdp, by_rank=False)["residuals"]
    _, into_ddp = ddp_side()
    into_ddp.load_state_dict({k: fsdp_state[k] for k in ("settings", "residuals")})
    back_from_ddp = into_ddp.state_dict()["residuals"]
    return {
        "ddp": kinds(ddp_state),
        "fsdp2": kinds(fsdp_state),
        "owed": all(v.abs().sum() > 0 for v in ddp_state["residuals"].values())
        and all(full(v).abs().sum() > 0 for v in fsdp_state["residuals"].values()),
        "ddp into fsdp2": all(torch.equal(full(back_from_fsdp[k]), v) for k, v in ddp_state["residuals"].items()),
        "fsdp2 into ddp": all(torch.equal(back_from_ddp[k], full(v)) for k, v in fsdp_state["residuals"].items()),
    }


def bad_input() -> list:
    def sharded():
        from torch.distributed.fsdp import fully_shard

        return fully_shard(make_model())

    def mismatched_state():
        model = sharded()
        torch_chainermn.fsdp.compress_between_nodes(model, compression={"code": "2bit"})
        torch_chainermn.fsdp.load_state_dict(model, {"0": torch.zeros(1)})

    return value_errors(
        [
            lambda: torch_chainermn.fsdp.two_hop(make_model()),
            lambda: _gloo_fsdp(),
            lambda: torch_chainermn.fsdp.compress_between_nodes(sharded(), gradients="int4"),
            lambda: torch_chainermn.fsdp.compress_between_nodes(sharded(), weights="2bit"),
            lambda: torch_chainermn.fsdp.compress_between_nodes(sharded(), block=0),
            lambda: torch_chainermn.fsdp.compress_between_nodes(sharded(), compression={"code": "2bit"}, threshold=0.0),
            mismatched_state,
            lambda: torch_chainermn.fsdp.compress_between_nodes(
                sharded(), compression={"code": "int8", "compress_result": True}
            ),
            lambda: torch_chainermn.fsdp.compress_between_nodes(
                sharded(), gradients="2bit", compression={"code": "2bit"}
            ),
        ]
    )


def differing_settings() -> dict:
    """compress_between_nodes with one setting on rank 0 and another on the others: the ValueError
    each rank raises ("" for none). The first is the 2-bit threshold under the old spelling."""
    from torch.distributed.fsdp import fully_shard

    first = dist.get_rank() == 0
    cases = {
        "old spelling": {"gradients": "2bit", "threshold": 0.5 if first else 0.25},
        "threshold": {"compression": {"code": "2bit", "threshold": 0.5 if first else 0.25}},
        "code": {"compression": {"code": "2bit" if first else "1bit"}},
        "block": {"compression": {"code": "int8", "block": 256 if first else 128}},
        "keep": {"compression": {"code": "topk", "keep": 8 if first else 4}},
        "weights": {"weights": "int8" if first else "float32"},
        "object": {
            "compression": torch_chainermn.hooks.GradientCompressionState(code="2bit", threshold=0.5 if first else 0.25)
        },
        "refused": {"block": 8 if first else 0},
    }
    return dict(
        zip(
            cases,
            value_errors(
                [
                    lambda kwargs=kwargs: torch_chainermn.fsdp.compress_between_nodes(
                        fully_shard(make_model()), **kwargs
                    )
                    for kwargs in cases.values()
                ]
            ),
        )
    )


def _gloo_fsdp():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DeviceMesh

    gloo = dist.new_group(backend="gloo")
    model = make_model()
    fully_shard(model, mesh=DeviceMesh.from_group(gloo, "cpu"))
    torch_chainermn.fsdp.two_hop(model)


def old_spelling_warns() -> list:
    """The warnings compress_between_nodes(model, "2bit") gives: (category, message, file)."""
    from torch.distributed.fsdp import fully_shard

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_chainermn.fsdp.compress_between_nodes(fully_shard(make_model()), "2bit")
    return [(w.category.__name__, str(w.message), Path(w.filename).name) for w in caught]


def cases(directory: str) -> dict:
    # The disagreements first: the cases after them show the group still in step.
    return {
        "differing": differing_settings(),
        "old spelling": old_spelling_warns(),
        "configs": matches_fsdp2(),
        "training": {code: coded_training(code) for code in ("int8", "2bit")},
        "exchange": {code: coded_exchange_matches_reference(code) for code in torch_chainermn.codes.CODES},
        "checkpoint": checkpoint_resumes_exactly(directory),
        "one format": one_format(),
        "errors": bad_input(),
    }


def cuda_cases() -> dict:
    """On the GPU (every rank shares it): the coded exchange against the plain rules."""
    torch.cuda.set_device(0)
    return {code: coded_exchange_matches_reference(code, "cuda") for code in torch_chainermn.codes.CODES}


def lm_validation_losses(steps: int = 40) -> dict:
    """The cluster benchmark's language model (benchmarks/cluster/lm.py), CI-sized, under FSDP2 with
    FSDP2's own collectives and with codes between nodes: the validation loss after `steps` AdamW
    steps from the same start on the same batches (every rank evaluates the same windows)."""
    import sys
    from pathlib import Path

    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "cluster"))
    import lm

    corpus = lm.load_corpus(max_mb=1.0)
    windows = lm.validation_windows(corpus.val, 32, 32)
    losses = {}
    for name, codes in (("fsdp2", None), ("int8", ("int8", "int8"))):
        torch.manual_seed(0)
        model = lm.ByteLM(dim=64, layers=1, heads=4, context=32)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if codes:
            torch_chainermn.fsdp.compress_between_nodes(model, compression={"code": codes[0]}, weights=codes[1])
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
        data = lm.batches(corpus.train, 8, 32, seed=dist.get_rank())
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lm.learning_rate(step, 2e-3, 10)
            inputs, targets = next(data)
            optimizer.zero_grad()
            lm.loss_of(model, inputs, targets).backward()
            optimizer.step()
        total, count = lm.validation_loss_sum(model, windows)
        losses[name] = total / count
    return losses
