"""LocalSGD and DiLoCo on real ranks, against DDP and against a plain-PyTorch reference of the rules.

Every rank is one replica (no DDP inside the replica) unless a case says otherwise. The reference
(`reference_diloco`) simulates every replica in one process, from the rules of torch_chainermn's
docstring written again plainly: inner steps alone; at a fragment's sync the mean over the replicas
of `global - local`; tau steps later the outer optimizer's step on the global value and the merge.
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import torch_chainermn
from torch_chainermn import hooks
from tests.support import compression_reference as compressed
from tests.support.collective_cases import value_errors

STEPS = 8
THRESHOLD = 0.004  # 2-bit's threshold: below the outer gradients of 3 AdamW steps at lr 0.01


def make_model(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm after the activation: before it, it would leave the first bias a zero gradient,
    # whose AdamW steps are rounding noise amplified to full steps.
    layers = [nn.Linear(6, 8), nn.Tanh()] + ([nn.BatchNorm1d(8)] if batch_norm else []) + [nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def train_step(model, optimizer, rank: int, step: int, device: str = "cpu") -> None:
    x, y = batch(rank, step)
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    optimizer.step()
    optimizer.zero_grad()


def flat(model) -> torch.Tensor:
    return torch.cat(
        [p.detach().reshape(-1) for p in model.parameters()]
        + [b.detach().reshape(-1) for b in model.buffers() if b.is_floating_point()]
    )


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


def nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


# ---- against DDP ----------------------------------------------------------------------------------


def ddp_trajectory(rank: int) -> list:
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = sgd(model.parameters())
    out = []
    for step in range(1, STEPS + 1):
        train_step(model, optimizer, rank, step)
        out.append(flat(model))
    return out


def equals_ddp_with_every_step_synced() -> None:
    """LocalSGD(H=1) and DiLoCo(inner SGD, outer SGD lr=1, H=1) take DDP's steps (SGD is linear)."""
    rank = dist.get_rank()
    expected = ddp_trajectory(rank)
    model = make_model()
    optimizer = sgd(model.parameters())
    with torch_chainermn.LocalSGD(model, optimizer, sync_every=1):
        for step in range(1, STEPS + 1):
            train_step(model, optimizer, rank, step)
            torch.testing.assert_close(
                flat(model), expected[step - 1], rtol=1e-5, atol=1e-6, msg=lambda m: f"LocalSGD, step {step}: {m}"
            )
    model = make_model()  # the same seed on every rank: equal replicas, so no broadcast is needed
    inner = sgd(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    with torch_chainermn.DiLoCo(model, inner, outer, sync_every=1, start="same"):
        for step in range(1, STEPS + 1):
            train_step(model, inner, rank, step)
            torch.testing.assert_close(
                flat(model), expected[step - 1], rtol=1e-5, atol=1e-6, msg=lambda m: f"DiLoCo, step {step}: {m}"
            )


# ---- against the rules, written plainly -----------------------------------------------------------


def warm_step(replicas, inners, step: int) -> None:
    """DDP's step for every replica: the replicas' gradients averaged before each inner step."""
    for rank, model in enumerate(replicas):
        x, y = batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
    for tensors in zip(*[[p.grad for p in m.parameters()] for m in replicas]):
        mean = torch.stack(tensors).mean(0)
        for grad in tensors:
            grad.copy_(mean)
    for inner in inners:
        inner.step()
        inner.zero_grad()


def float_buffers(model) -> list:
    return [b for b in model.buffers() if b.is_floating_point()]


def reference_diloco(
    world: int,
    nodes: list,
    runs: list,
    H: int,
    F: int,
    tau: int,
    alpha: float,
    kind: str,
    batch_norm: bool,
    warmup: int = 0,
) -> list:
    """[step][rank] -> flat(replica) for every replica, from the rules.

    runs: each fragment's parameter indices (in model.parameters() order).
    kind: "float32" (the mean of the outer gradients) or "2bit" (compression_reference's compressed
    mean between `nodes`, one residual per node and fragment, kept across syncs).
    warmup: the first `warmup` steps are DDP's (the replicas' gradients averaged before each inner
    step); the global value is then the replicas' (equal) parameters, and the syncs count from there.
    """
    replicas = [make_model(batch_norm) for _ in range(world)]
    inners = [adamw(m.parameters()) for m in replicas]
    global_model = make_model(batch_norm)
    outer = nesterov(global_model.parameters())
    offsets = [i * H // F for i in range(F)]
    residuals = [None] * F
    pending = {}

    def params(model, i):
        every = list(model.parameters())
        return [every[j] for j in runs[i]]

    def buffers(model):
        return [b for b in model.buffers() if b.is_floating_point()]

    history = []
    for step in range(1, STEPS + 1):
        if step <= warmup:
            warm_step(replicas, inners, step)
            if step == warmup:
                with torch.no_grad():
                    for g, p in zip(global_model.parameters(), replicas[0].parameters()):
                        g.copy_(p)
            history.append([flat(m) for m in replicas])
            continue
        for rank in range(world):
            train_step(replicas[rank], inners[rank], rank, step)
        after = step - warmup
        for i in range(F):
            if after >= offsets[i] and (after - offsets[i]) % H == 0:
                deltas = [
                    torch.cat(
                        [(g - p).detach().reshape(-1) for g, p in zip(params(global_model, i), params(replicas[r], i))]
                    )
                    for r in range(world)
                ]
                if kind == "float32":
                    mean = torch.stack(deltas).mean(0)
                else:
                    means, residuals[i], _ = compressed.compressed_mean_steps(
                        [deltas], nodes, 1, "2bit", threshold=THRESHOLD, residuals=residuals[i]
                    )
                    mean = means[0]
                buffer_mean = None
                if i == 0 and batch_norm:
                    buffer_mean = [
                        torch.stack([buffers(m)[k] for m in replicas]).mean(0)
                        for k in range(len(buffers(global_model)))
                    ]
                pending[i] = (step + tau, mean, buffer_mean)
        for i in range(F):
            if i in pending and pending[i][0] == step:
                _, mean, buffer_mean = pending.pop(i)
                for p in global_model.parameters():
                    p.grad = None
                offset = 0
                for p in params(global_model, i):
                    p.grad = mean[offset : offset + p.numel()].view(p.shape).clone()
                    offset += p.numel()
                outer.step()
                with torch.no_grad():
                    for model in replicas:
                        for mine, new in zip(params(model, i), params(global_model, i)):
                            mine.copy_(alpha * mine + (1 - alpha) * new if tau else new)
                        if buffer_mean is not None:
                            for mine, new in zip(buffers(model), buffer_mean):
                                mine.copy_(alpha * mine + (1 - alpha) * new if tau else new)
        history.append([flat(m) for m in replicas])
    return history


def reference_eager(
    world: int, nodes: list, runs: list, H: int, kind: str, batch_norm: bool, warmup: int = 0, batch_of=batch
) -> list:
    """[step][replica] -> flat(replica) under eager updates (DiLoCo's `eager`) for M = world replicas,
    replica r training on batch_of(r, step) (default: one replica per rank, on its rank's batches).

    Written from the paper's rule (Kale, Douillard et al. 2025): at fragment i's sync, replica r steps
    its OWN outer optimizer, on its OWN global value, with
        (sum over the other replicas q of what q sent at i's last sync + r's outer gradient now) / M
    and takes the result; what every replica sent (zeros before the first sync) is then its outer
    gradient now. With a code ("2bit") the others' part is the compressed mean of the last sync less
    r's share of what r sent (a code's sum cannot be split by sender). Floating buffers: (the others'
    buffers at the last sync + r's own now) / M, the start (or the end of the warm start) counting as
    the first "sent".
    """
    replicas = [make_model(batch_norm) for _ in range(world)]
    inners = [adamw(m.parameters()) for m in replicas]
    globals_ = [make_model(batch_norm) for _ in range(world)]  # every replica's own global value
    outers = [nesterov(g.parameters()) for g in globals_]  # and its own outer optimizer
    offsets = [i * H // len(runs) for i in range(len(runs))]
    sizes = [sum(list(replicas[0].parameters())[j].numel() for j in run) for run in runs]
    sent = [[torch.zeros(n) for n in sizes] for _ in range(world)]
    means = [torch.zeros(n) for n in sizes]
    residuals = [None] * len(runs)
    sent_buffers = [[b.clone() for b in float_buffers(m)] for m in replicas]

    def params(model, i):
        every = list(model.parameters())
        return [every[j] for j in runs[i]]

    history = []
    for step in range(1, STEPS + 1):
        if step <= warmup:
            warm_step(replicas, inners, step)
            if step == warmup:
                with torch.no_grad():
                    for g, model in zip(globals_, replicas):
                        for mine, theirs in zip(g.parameters(), model.parameters()):
                            mine.copy_(theirs)
                sent_buffers = [[b.clone() for b in float_buffers(m)] for m in replicas]
            history.append([flat(m) for m in replicas])
            continue
        for r in range(world):
            x, y = batch_of(r, step)
            nn.functional.mse_loss(replicas[r](x), y).backward()
            inners[r].step()
            inners[r].zero_grad()
        after = step - warmup
        for i in range(len(runs)):
            if not (after >= offsets[i] and (after - offsets[i]) % H == 0):
                continue
            fresh = [
                torch.cat(
                    [(g - p).detach().reshape(-1) for g, p in zip(params(globals_[r], i), params(replicas[r], i))]
                )
                for r in range(world)
            ]
            for r in range(world):
                if kind == "float32":
                    grad = (sum(sent[q][i] for q in range(world) if q != r) + fresh[r]) / world
                else:
                    grad = means[i] - sent[r][i] / world + fresh[r] / world
                for p in globals_[r].parameters():
                    p.grad = None
                offset = 0
                for p in params(globals_[r], i):
                    p.grad = grad[offset : offset + p.numel()].view(p.shape).clone()
                    offset += p.numel()
                outers[r].step()
                with torch.no_grad():
                    for mine, new in zip(params(replicas[r], i), params(globals_[r], i)):
                        mine.copy_(new)
            if i == 0 and batch_norm:
                now = [[b.clone() for b in float_buffers(m)] for m in replicas]
                with torch.no_grad():
                    for r in range(world):
                        for k, mine in enumerate(float_buffers(replicas[r])):
                            mine.copy_((sum(sent_buffers[q][k] for q in range(world) if q != r) + now[r][k]) / world)
                sent_buffers = now
            for r in range(world):
                sent[r][i] = fresh[r]
            if kind == "float32":
                means[i] = torch.stack(fresh).mean(0)
            else:
                mean, residuals[i], _ = compressed.compressed_mean_steps(
                    [fresh], nodes, 1, kind, threshold=THRESHOLD, residuals=residuals[i]
                )
                means[i] = mean[0]
        history.append([flat(m) for m in replicas])
    return history


def diloco_for(model, H, F, tau, kind, alpha=0.5, warmup=0, eager=False):
    inner = adamw(model.parameters())
    outer = nesterov(model.parameters())
    compression = {
        "2bit": hooks.GradientCompressionState(code="2bit", threshold=THRESHOLD),
        "4bit": {"code": "4bit", "compress_result": True},
        "topk": {"code": "topk", "block": 16, "keep": 4, "compress_result": True},
    }.get(kind)
    diloco = torch_chainermn.DiLoCo(
        model,
        inner,
        outer,
        sync_every=H,
        fragments=F,
        fragment_delay=tau,
        compression=compression,
        fragment_update_alpha=alpha,
        warmup_steps=warmup,
        eager=eager,
    )
    return inner, outer, diloco


def runs_of(diloco, model) -> list:
    index = {id(p): j for j, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in fragment.params] for fragment in diloco.fragments]


def equals_reference(configs) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = torch_chainermn.topology()
    nodes = [list(topo.ranks_of_node[n]) for n in range(topo.inter_size)]
    for H, F, tau, kind, batch_norm, alpha, *warm in configs:
        warmup = warm[0] if warm else 0
        model = make_model(batch_norm)
        inner, _, diloco = diloco_for(model, H, F, tau, kind, alpha=alpha, warmup=warmup)
        expected = reference_diloco(world, nodes, runs_of(diloco, model), H, F, tau, alpha, kind, batch_norm, warmup)
        follows_reference(
            diloco,
            model,
            inner,
            expected,
            rank,
            f"H={H} F={F} tau={tau} {kind} batch_norm={batch_norm} warmup={warmup}",
        )


def eager_equals_reference(configs) -> None:
    """Eager updates against reference_eager, every step, for (H, F, kind, batch_norm, warmup) configs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = torch_chainermn.topology()
    nodes = [list(topo.ranks_of_node[n]) for n in range(topo.inter_size)]
    for H, F, kind, batch_norm, warmup in configs:
        model = make_model(batch_norm)
        inner, _, diloco = diloco_for(model, H, F, 0, kind, warmup=warmup, eager=True)
        expected = reference_eager(world, nodes, runs_of(diloco, model), H, kind, batch_norm, warmup)
        follows_reference(
            diloco, model, inner, expected, rank, f"eager H={H} F={F} {kind} batch_norm={batch_norm} warmup={warmup}"
        )


def follows_reference(diloco, model, inner, expected, rank: int, label: str) -> None:
    """Train STEPS steps under `diloco`; after each, this rank's replica must be expected[step][rank]."""
    with diloco:
        for step in range(1, STEPS + 1):
            train_step(model, inner, rank, step)
            torch.testing.assert_close(
                flat(model), expected[step - 1][rank], rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}, step {step}: {m}"
            )


# ---- checkpoints ----------------------------------------------------------------------------------


def resumes_exactly(configs, eager: bool = False) -> None:
    """Stop after `stop` steps (between syncs, or with a fragment in flight), save, start a new
    model, optimizers and DiLoCo, load, finish: the same parameters as the run that never stopped.
    With eager updates an exchange is in flight at every stop after the first sync."""
    rank = dist.get_rank()
    for H, F, tau, kind, stop, through_dcp, *warm in configs:
        warmup = warm[0] if warm else 0
        model = make_model(batch_norm=True)
        inner, _, diloco = diloco_for(model, H, F, tau, kind, warmup=warmup, eager=eager)
        with diloco:
            for step in range(1, STEPS + 1):
                train_step(model, inner, rank, step)
                if step == stop:
                    if eager:
                        assert any(f.work is not None for f in diloco.fragments), "no exchange in flight"
                    assert tau == 0 or stop <= warmup or any(f.apply_at is not None for f in diloco.fragments), (
                        "none in flight"
                    )
                    saved = copy.deepcopy(
                        {"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}
                    )
        straight = flat(model)

        model = make_model(batch_norm=True)
        for p in model.parameters():
            p.data.add_(1.0)  # a fresh start that is not the saved one
        inner, _, diloco = diloco_for(model, H, F, tau, kind, warmup=warmup, eager=eager)
        if through_dcp:
            # DiLoCo's state is the same on every rank, as DCP takes a plain tensor to be; the
            # replicas' own models and inner optimizers differ between syncs, so they are not.
            import torch.distributed.checkpoint as dcp

            template = {"diloco": diloco.state_dict()}
            directory = [tempfile.mkdtemp(prefix="diloco-dcp-") if rank == 0 else None]
            dist.broadcast_object_list(directory)
            dcp.save({"diloco": saved["diloco"]}, checkpoint_id=directory[0])
            dcp.load(template, checkpoint_id=directory[0])
            saved["diloco"] = template["diloco"]
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])
        diloco.load_state_dict(saved["diloco"])
        with diloco:
            for step in range(stop + 1, STEPS + 1):
                train_step(model, inner, rank, step)
        assert torch.equal(flat(model), straight), (
            f"H={H} F={F} tau={tau} {kind} eager={eager}, stopped after {stop}, dcp={through_dcp}: "
            f"max difference {(flat(model) - straight).abs().max()}"
        )
        if eager:  # an eager state does not load into a DiLoCo without eager updates
            other = make_model(batch_norm=True)
            _, _, plain = diloco_for(other, H, F, tau, kind, warmup=warmup)
            try:
                plain.load_state_dict(saved["diloco"])
            except ValueError as error:
                assert (
                    "DiLoCo.load_state_dict: the state was saved with eager=True, this DiLoCo has eager=False"
                    in str(error)
                ), error
            else:
                raise AssertionError("an eager state loaded into a DiLoCo without eager updates")


# ---- one replica per node -------------------------------------------------------------------------


def one_replica_per_node() -> None:
    """DDP over node_group(), DiLoCo over the world: the node's ranks stay equal (they train one
    replica), the nodes meet every H steps."""
    rank = dist.get_rank()
    topo = torch_chainermn.topology()
    node = torch_chainermn.node_group()
    assert node is torch_chainermn.node_group()
    assert sorted(dist.get_process_group_ranks(node)) == list(topo.ranks_of_node[topo.node_of_rank[rank]])
    model = nn.parallel.DistributedDataParallel(make_model(), process_group=node)
    inner, _, diloco = diloco_for(model, 3, 1, 0, "float32")
    with diloco:
        for step in range(1, STEPS + 1):
            train_step(model, inner, rank, step)
    mine = flat(model)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    for other in topo.ranks_of_node[topo.node_of_rank[rank]]:
        assert torch.equal(everyone[other], mine), f"ranks {rank} and {other} of one node differ"

    # Eager updates with a replica per node: M is the number of nodes (the replica's share of the
    # mean is its node's ranks' shares), as the reference with one replica per node on the node's
    # batches (DDP's mean of its ranks' losses is the loss of their batches together) says.
    nodes = [list(topo.ranks_of_node[n]) for n in range(topo.inter_size)]

    def node_batch(node_index, step):
        x, y = zip(*(batch(q, step) for q in nodes[node_index]))
        return torch.cat(x), torch.cat(y)

    model = nn.parallel.DistributedDataParallel(make_model(), process_group=node)
    inner, _, diloco = diloco_for(model, 3, 1, 0, "float32", eager=True)
    expected = reference_eager(len(nodes), nodes, runs_of(diloco, model), 3, "float32", False, batch_of=node_batch)
    with diloco:
        for step in range(1, STEPS + 1):
            train_step(model, inner, rank, step)
            torch.testing.assert_close(
                flat(model),
                expected[step - 1][topo.node_of_rank[rank]],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m: f"eager, one replica per node, step {step}: {m}",
            )


# ---- bad input ------------------------------------------------------------------------------------


def bad_input() -> list:
    """The ValueError each bad call raises on this rank ("" where none was raised)."""
    rank = dist.get_rank()
    model = make_model()
    other = nn.Linear(2, 2)
    unequal = make_model()
    if rank == 1:
        with torch.no_grad():
            unequal[2].bias[1] += 1.0

    def diloco(of=model, **kwargs):
        args = {
            "model": of,
            "inner_optimizer": adamw(of.parameters()),
            "outer_optimizer": nesterov(of.parameters()),
            "sync_every": 4,
        }
        args.update(kwargs)
        return torch_chainermn.DiLoCo(**args)

    calls = [
        lambda: diloco(sync_every=0),
        lambda: torch_chainermn.LocalSGD(model, adamw(model.parameters()), sync_every=0),
        lambda: diloco(fragments=0),
        lambda: diloco(fragments=5),  # 4 parameters
        lambda: diloco(fragments=2, fragment_delay=2),  # must be < 4 / 2
        lambda: diloco(outer_optimizer=nesterov(other.parameters())),
        lambda: diloco(compression="2bit"),
        lambda: diloco(of=nn.Linear(6, 3 + rank)),  # shapes differ across ranks
        lambda: diloco(sync_every=0 if rank == 1 else 4),  # bad on one rank only
        lambda: diloco(fragment_delay=1 if rank == 0 else 0),  # settings differ across ranks
        lambda: diloco(warmup_steps=-1),
        lambda: diloco(start="rank0"),
        lambda: diloco(of=unequal, start="same"),  # replicas that do not start equal
        lambda: torch_chainermn.LocalSGD(unequal, adamw(unequal.parameters()), sync_every=2, start="same"),
        lambda: diloco(eager=True, fragment_delay=1),  # eager has no delayed mean to merge
        lambda: diloco(eager="yes"),
        lambda: diloco(eager=rank == 0),  # eager on one rank only
    ]
    return value_errors(calls)


def two_nodes_of_one() -> list:
    equals_ddp_with_every_step_synced()
    equals_reference(
        [(3, 1, 0, "float32", False, 0.5), (3, 2, 1, "2bit", False, 0.5), (2, 2, 0, "float32", False, 0.5, 3)]
    )  # a warm start of 3 steps
    eager_equals_reference([(3, 1, "float32", False, 0), (2, 2, "2bit", False, 0)])
    return bad_input()


def two_nodes_of_two() -> None:
    equals_ddp_with_every_step_synced()
    equals_reference(
        [
            (3, 1, 0, "float32", True, 0.5),
            (3, 2, 0, "float32", False, 0.5),
            (3, 2, 1, "float32", True, 0.25),
            (3, 1, 0, "2bit", False, 0.5),
            (3, 2, 1, "2bit", True, 0.5),
            (3, 2, 1, "2bit", True, 0.5, 2),
        ]
    )  # a warm start of 2 steps, with buffers
    resumes_exactly(
        [
            (3, 1, 0, "float32", 4, False),  # between syncs
            (3, 2, 1, "2bit", 4, False),  # fragment 1 in flight (started at 4, applied at 5)
            (3, 2, 1, "2bit", 4, True),  # the same through torch.distributed.checkpoint
            (3, 2, 1, "2bit", 2, False, 3),
        ]
    )  # during a warm start of 3 steps
    eager_equals_reference([(3, 1, "float32", True, 0), (3, 2, "2bit", True, 0), (3, 1, "float32", True, 2)])
    resumes_exactly(
        [
            (3, 1, 0, "float32", 4, False),  # round 1's exchange in flight (started at 3)
            (3, 2, 0, "4bit", 5, False),  # both fragments' in flight
            (3, 1, 0, "topk", 7, False),
        ],
        eager=True,
    )
    one_replica_per_node()


# ---- CUDA (tests/test_cuda_torch_parallel.py) -----------------------------------------------------


def cuda_matches_cpu() -> dict:
    """Streaming DiLoCo (H=3, F=2, tau=1, BatchNorm) with the model on the GPU and on the CPU, float32
    and 2-bit outer gradients: the largest difference between the two trajectories, and how far the
    GPU run moved from its start."""
    torch.cuda.set_device(0)  # every rank shares the one GPU
    rank = dist.get_rank()
    outcome = {}
    for kind in ("float32", "2bit"):
        trajectories = {}
        for device in ("cpu", "cuda"):
            model = make_model(batch_norm=True).to(device)
            inner, _, diloco = diloco_for(model, 3, 2, 1, kind)
            trajectory = [flat(model).cpu()]
            with diloco:
                for step in range(1, STEPS + 1):
                    train_step(model, inner, rank, step, device)
                    trajectory.append(flat(model).cpu())
            trajectories[device] = trajectory
        cpu, cuda = trajectories["cpu"], trajectories["cuda"]
        outcome[kind] = {
            "difference": max((a - b).abs().max().item() for a, b in zip(cpu, cuda)),
            "moved": (cuda[-1] - cuda[0]).abs().max().item(),
        }
    return outcome
