"""PyTorch Lightning's DDP on the chainermn backend: the whole change is `process_group_backend`.

    torchrun --nproc-per-node 2 examples/recipes/lightning_ddp.py
    CHAINERMN_COMMUNICATOR=flat mpiexec -n 2 python examples/recipes/lightning_ddp.py

A small regression model trained for a few epochs. Lightning's `self.log(..., sync_dist=True)` averages
the logged values over the ranks (an all_reduce with AVG; its batch-size counter is an int64 tensor,
which chainermn averages as NCCL does). Rank 0 prints the logged loss of each epoch and a checksum of
the final weights, which every rank computes alike (DDP keeps the replicas equal).
"""

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

import torch_chainermn  # noqa: F401  registers the backend (also done by torch's autoload when installed)


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self):
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch} loss {self.trainer.callback_metrics['loss'].item():.6f}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(samples: int = 512) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main():
    L.seed_everything(0, verbose=False)
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DDPStrategy(process_group_backend="chainermn"),
        max_epochs=int(os.environ.get("EPOCHS", "3")),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, DataLoader(data(), batch_size=32))
    checksum = torch.tensor(sum(p.detach().double().sum().item() for p in model.parameters()))
    every = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(every, checksum)
    if dist.get_rank() == 0:
        print(
            f"backend {dist.get_backend()} ranks {dist.get_world_size()} "
            f"weights {' '.join(f'{c.item():.12f}' for c in every)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
