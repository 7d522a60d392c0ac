"""An averaging ensemble trained across processes (ChainerMN's model-parallel guide, Example 2).

    torchrun --nproc-per-node 3 examples/model_parallel/train_ensemble_allgather.py
    mpiexec -n 3 python examples/model_parallel/train_ensemble_allgather.py

Each process holds one member of the ensemble: an MLP with its own initialisation. In forward every
member predicts on the same batch, the predictions are allgathered (differentiable:
torch_chainermn.functions.allgather), stacked and averaged, and the loss is that of the average:

    h = member(x)
    h = torch_chainermn.functions.allgather(comm, h)
    y = torch.stack(h).mean(0)

So each member learns what helps the ensemble, not what helps itself alone. Every rank computes the
same loss; allgather's backward sums every rank's gradient for a member's prediction into that member
(a reduce-scatter), so the loss is divided by the number of members to count it once. All ranks read
the same batches (same seed). Rank 0 reports the ensemble's test accuracy and each member's own.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import torch_chainermn
from torch_chainermn import functions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mnist"))
from train_mnist import MLP, load_digits, to_dataset, write_json_atomically  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description="ChainerMN example: an ensemble averaged with allgather")
    parser.add_argument("--batchsize", "-b", type=int, default=100)
    parser.add_argument("--epoch", "-e", type=int, default=10)
    parser.add_argument("--unit", "-u", type=int, default=100, help="units per hidden layer of each member")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split and shuffling (members differ)")
    parser.add_argument("--out", type=Path, help="rank 0 writes a JSON summary here")
    return parser.parse_args()


def ensemble(comm, member, x):
    h = functions.allgather(comm, member(x))
    return torch.stack(h, dim=0).mean(dim=0), h[comm.rank]


def main():
    args = parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    comm = torch_chainermn.create_communicator("naive")
    train_split, test_split = load_digits(args.seed)  # small: every rank reads it
    train, test = to_dataset(train_split), to_dataset(test_split)

    torch.manual_seed(1000 + comm.rank)  # each member its own initialisation
    member = MLP(train[0][0].numel(), args.unit)
    optimizer = torch.optim.Adam(member.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    start = time.perf_counter()
    for epoch in range(1, args.epoch + 1):
        member.train()
        for x, t in DataLoader(train, batch_size=args.batchsize, shuffle=True, generator=generator):
            optimizer.zero_grad()
            y, _ = ensemble(comm, member, x)
            (F.cross_entropy(y, t) / comm.size).backward()
            optimizer.step()
        member.eval()
        with torch.no_grad():
            x, t = test.tensors
            y, own = ensemble(comm, member, x)
            accuracy = (y.argmax(1) == t).float().mean().item()
            members = [a.item() for a in comm.allgather((own.argmax(1) == t).float().mean())]
        if comm.rank == 0:
            print(
                f"epoch {epoch}  ensemble test/accuracy {accuracy:.4f}  members "
                f"{' '.join(f'{a:.4f}' for a in members)}  elapsed {time.perf_counter() - start:.1f}s",
                flush=True,
            )
    if comm.rank == 0:
        print(
            f"final test accuracy: {accuracy:.4f} (ensemble of {comm.size}; members "
            f"{' '.join(f'{a:.4f}' for a in members)})",
            flush=True,
        )
        if args.out is not None:
            write_json_atomically(
                args.out,
                {
                    "world_size": comm.size,
                    "final_accuracy": accuracy,
                    "member_accuracies": members,
                    "epochs": args.epoch,
                },
            )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
