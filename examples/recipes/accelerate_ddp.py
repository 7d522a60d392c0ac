"""Hugging Face Accelerate on the chainermn backend.

    torchrun --nproc-per-node 2 examples/recipes/accelerate_ddp.py
    mpiexec -n 2 python examples/recipes/accelerate_ddp.py

Accelerate picks its CPU backend itself and accepts only gloo and mpi there, so the process group is
created first, with chainermn; Accelerate then uses the group it finds. The rest is Accelerate's usual
loop: prepare, backward through the accelerator, gather for metrics. Rank 0 prints the loss of each
epoch and a checksum of the final weights of every rank (DDP keeps the replicas equal).
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import torch_chainermn

from accelerate import Accelerator
from accelerate.utils import set_seed


def data(samples: int = 512) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main():
    # Before the Accelerator: it would otherwise create a gloo group (its check refuses other CPU backends).
    dist.init_process_group("chainermn")
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data(), batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(3):
        total = torch.zeros(())
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()
        mean = accelerator.gather(total.reshape(1)).mean().item() / len(loader)
        accelerator.print(f"epoch {epoch} loss {mean:.6f}")
    checksum = torch.tensor(sum(p.detach().double().sum().item() for p in model.parameters())).reshape(1)
    every = accelerator.gather(checksum)
    accelerator.print(
        f"backend {dist.get_backend()} ranks {accelerator.num_processes} "
        f"weights {' '.join(f'{c.item():.12f}' for c in every)} "
        f"chainermn {torch_chainermn.get_options().communicator}"
    )
    accelerator.end_training()  # destroys the process group too


if __name__ == "__main__":
    main()
