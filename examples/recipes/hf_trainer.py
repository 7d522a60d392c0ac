"""Hugging Face Trainer (transformers) on the chainermn backend.

    torchrun --nproc-per-node 2 examples/recipes/hf_trainer.py
    mpiexec -n 2 python examples/recipes/hf_trainer.py

The Trainer asks Accelerate for its process group, and Accelerate accepts only gloo and mpi as CPU
backends (`TrainingArguments(ddp_backend="chainermn", use_cpu=True)` is refused), so the group is
created first, with chainermn, before the TrainingArguments: Accelerate then uses the group it finds.
On a machine without a GPU `use_cpu=True` is needed as well: without it the Trainer does not go distributed and
every rank trains alone (`args.world_size` 1, `args.parallel_mode` NOT_PARALLEL, a warning only).

A tiny regression model defined here and a synthetic data set, a few steps of DDP. Rank 0 prints the
loss of each step (averaged over the ranks by the Trainer), what the Trainer saw (world size, parallel
mode, the DDP wrapper) and a digest of every rank's final parameters (DDP keeps the replicas
bit-equal). With `--backends chainermn gloo` the whole run is repeated on gloo (the group destroyed
and created anew), so the digests can be compared.
"""

import argparse
import hashlib
import os
import tempfile

import torch
import torch.distributed as dist

import torch_chainermn  # noqa: F401  registers the backend (also done by torch's autoload when installed)

from transformers import Trainer, TrainingArguments


class Regression(torch.nn.Module):
    """A model as the Trainer wants one: forward(**batch) returns a dict with the loss."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, samples: int = 256):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 8, generator=generator)
        self.y = 0.25 * self.x.sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(steps: int) -> None:
    """Train on the group there is; rank 0 prints what the Trainer saw and every rank's digest."""
    args = TrainingArguments(
        use_cpu=True,  # without it, on a machine without a GPU, no DDP: every rank trains alone
        output_dir=os.path.join(tempfile.gettempdir(), "hf_trainer_recipe"),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        optim="sgd",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
        dataloader_pin_memory=False,
        ddp_find_unused_parameters=False,
    )
    torch.manual_seed(0)
    model = Regression()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model=model, args=args, train_dataset=Synthetic())
    trainer.train()
    moved = sum((p.detach() - b).norm().item() ** 2 for p, b in zip(model.parameters(), before)) ** 0.5
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest(model))
    if dist.get_rank() == 0:
        backend = dist.get_backend()
        losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
        print(f"backend {backend} losses {' '.join(f'{v:.6f}' for v in losses)}", flush=True)
        print(
            f"backend {backend} trainer world_size {args.world_size} parallel_mode {args.parallel_mode.value} "
            f"model {type(trainer.model_wrapped).__name__}",
            flush=True,
        )
        print(
            f"backend {backend} ranks {dist.get_world_size()} moved {moved:.6f} weights {' '.join(every)}", flush=True
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["chainermn"])
    parser.add_argument("--steps", type=int, default=8)
    options = parser.parse_args()
    for backend in options.backends:
        # Before the TrainingArguments: they set up Accelerate's state, which would otherwise create a gloo group.
        dist.init_process_group(backend)
        train(options.steps)
        dist.destroy_process_group()  # the Trainer leaves the group to whoever created it


if __name__ == "__main__":
    main()
