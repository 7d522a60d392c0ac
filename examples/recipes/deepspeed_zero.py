"""DeepSpeed ZeRO (stages 1, 2 and 3) on the chainermn backend, on CPU.

    torchrun --nproc-per-node 2 examples/recipes/deepspeed_zero.py
    torchrun --nproc-per-node 2 examples/recipes/deepspeed_zero.py --backends chainermn gloo
    mpiexec -n 2 python examples/recipes/deepspeed_zero.py

`deepspeed.init_distributed(dist_backend="chainermn")`, after `import torch_chainermn`, creates the
group (DeepSpeed passes the name on to torch.distributed); the engines then run their collectives
through it (stages 1 and 2: all-reduces of the gradients, all-gathers of the updated partitions;
stage 3: reduce-scatters of the gradients, all-gathers of the partitioned parameters).

A tiny regression model defined here, trained for a few steps under each ZeRO stage with
torch.optim.AdamW, each rank on its own slice of a synthetic data set. Rank 0 prints the loss of
each step and a digest of every rank's final full parameters (stage 3 gathers them first). With
`--backends chainermn gloo` the whole run is repeated on gloo (the group destroyed and created anew),
so the digests can be compared.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist

import torch_chainermn  # noqa: F401  registers the backend (also done by torch's autoload when installed)

import deepspeed
import deepspeed.comm


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def digest(parameters) -> str:
    h = hashlib.sha256()
    for p in parameters:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(stage: int, steps: int, batch: int = 8) -> tuple[list, str, float]:
    """ZeRO `stage` for `steps` steps; returns the mean loss of each step over the ranks, this rank's
    digest of the final full parameters and how far they moved."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Regression()
    before = [p.detach().clone() for p in model.parameters()]
    # stage3_param_persistence_threshold 0: stage 3 partitions even parameters this small (by default it
    # keeps those under 100k elements whole on every rank).
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch * world, 8, generator=generator)
    y = 0.25 * x.sum(dim=1, keepdim=True)
    losses = []
    for step in range(steps):
        rows = slice((step * world + rank) * batch, (step * world + rank + 1) * batch)  # this rank's share
        loss = torch.nn.functional.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    params = list(engine.module.parameters())
    # Stage 3 keeps only this rank's partition of each parameter: gather the full ones to look at them.
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        final = digest(params)
        moved = sum((p.detach() - b).norm().item() ** 2 for p, b in zip(params, before)) ** 0.5
    engine.destroy()
    return losses, final, moved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["chainermn"])
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=6)
    options = parser.parse_args()
    for backend in options.backends:
        deepspeed.init_distributed(dist_backend=backend)
        for stage in options.stages:
            losses, final, moved = train(stage, options.steps)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, final)
            if dist.get_rank() == 0:
                print(
                    f"backend {dist.get_backend()} stage {stage} losses {' '.join(f'{v:.6f}' for v in losses)}",
                    flush=True,
                )
                print(
                    f"backend {dist.get_backend()} stage {stage} ranks {dist.get_world_size()} moved {moved:.6f} "
                    f"weights {' '.join(every)}",
                    flush=True,
                )
        deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached groups: the next backend starts clean


if __name__ == "__main__":
    main()
