"""ChainerMN's model-parallel MNIST example: one MLP, its layers split over the processes.

    torchrun --nproc-per-node 2 examples/model_parallel/train_mnist_model_parallel.py
    mpiexec -n 3 python examples/model_parallel/train_mnist_model_parallel.py --pipeline 4

(as root, mpiexec also needs --allow-run-as-root, and --oversubscribe for more ranks than cores).

The MLP of the MNIST tutorial (l1, relu, l2, relu, l3) is cut into as many consecutive parts as there
are processes: with 2, rank 0 runs l1 and rank 1 runs l2 and l3; with 3, one layer each. Rank 0 holds
the data: its part sends to rank 1, and a last component (an identity) receives the output back from
the last rank, so rank 0 computes the loss and the accuracy, as in ChainerMN's example. The other
ranks need no data (ChainerMN gave them create_empty_dataset): each step they call their chain with
no input and backprop from the delegate variable it returns.

Every rank builds the whole MLP from the same seed and keeps its part, so the split model starts
where one process would, sees the same batches and takes the same Adam steps: it trains to the same
accuracy (to rounding). --check-single trains that one-process MLP on rank 0 alongside and prints both.
--pipeline M splits each batch into M micro-batches that flow through the ranks one after another
(GPipe: torch_chainermn.MultiNodeChainList(comm, micro_batches=M)); the gradients are the same.
With one process the whole MLP is a single component.

Data: scikit-learn's 8x8 digits (no download), or the MNIST IDX files of --data-dir.
"""

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import torch_chainermn  # registers the "chainermn" backend (and, under mpiexec, reads rank and size from MPI)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mnist"))
from train_mnist import MLP, load_digits, load_mnist, to_dataset, write_json_atomically  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description="ChainerMN example: an MLP split over processes")
    parser.add_argument("--batchsize", "-b", type=int, default=100, help="minibatch size")
    parser.add_argument("--epoch", "-e", type=int, default=20, help="number of sweeps over the training set")
    parser.add_argument("--unit", "-u", type=int, default=1000, help="number of units in each hidden layer")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, the data split and the shuffling")
    parser.add_argument("--pipeline", type=int, default=1, metavar="M", help="micro-batches per batch (default 1)")
    parser.add_argument(
        "--check-single",
        action="store_true",
        help="rank 0 also trains the whole MLP on its own, and reports both accuracies",
    )
    parser.add_argument("--data-dir", type=Path, help="directory holding the MNIST IDX files (default: sklearn digits)")
    parser.add_argument("--out", type=Path, help="rank 0 writes a JSON summary of the run here")
    return parser.parse_args()


def split_layers(mlp: MLP, parts: int) -> list[torch.nn.Sequential]:
    """The MLP's layers, in order, cut into `parts` consecutive pieces (a ReLU stays with its layer)."""
    layers = [torch.nn.Sequential(mlp.l1, torch.nn.ReLU()), torch.nn.Sequential(mlp.l2, torch.nn.ReLU()), mlp.l3]
    if not 1 <= parts <= len(layers):
        raise SystemExit(f"this example splits its 3 layers over 1 to 3 processes, not {parts}")
    bounds = [round(i * len(layers) / parts) for i in range(parts + 1)]
    return [torch.nn.Sequential(*layers[bounds[i] : bounds[i + 1]]) for i in range(parts)]


def build_chain(comm, mlp: MLP, micro_batches: int) -> torch_chainermn.MultiNodeChainList:
    part = split_layers(mlp, comm.size)[comm.rank]
    chain = torch_chainermn.MultiNodeChainList(comm, micro_batches=micro_batches)
    if comm.size == 1:
        chain.add_link(part)
    elif comm.rank == 0:
        chain.add_link(part, rank_in=None, rank_out=1)
        chain.add_link(torch.nn.Identity(), rank_in=comm.size - 1, rank_out=None)  # the output comes back
    else:
        chain.add_link(part, rank_in=comm.rank - 1, rank_out=(comm.rank + 1) % comm.size)
    return chain


@torch.no_grad()
def evaluate(comm, model, test):
    """Test accuracy (rank 0; None elsewhere). The other ranks run their parts for every batch too."""
    model.eval()
    if comm.rank != 0:
        for _ in range(comm.bcast_obj(None)):
            model()
        return None
    loader = DataLoader(test, batch_size=1000)
    comm.bcast_obj(len(loader))
    correct = sum((model(x).argmax(1) == t).sum().item() for x, t in loader)
    return correct / len(test)


def main():
    args = parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # several ranks share few cores
    comm = torch_chainermn.create_communicator("naive")
    if comm.rank == 0:
        print(
            f"world size: {comm.size}  transport: {torch_chainermn.transport(comm.group)}  "
            f"micro-batches: {args.pipeline}",
            flush=True,
        )

    # Rank 0 alone has data; it tells the others how many batches an epoch has.
    train = test = None
    if comm.rank == 0:
        splits = load_mnist(args.data_dir) if args.data_dir else load_digits(args.seed)
        train, test = to_dataset(splits[0]), to_dataset(splits[1])
    n_in = comm.bcast_obj(train[0][0].numel() if comm.rank == 0 else None)

    torch.manual_seed(args.seed)
    mlp = MLP(n_in, args.unit)  # the whole MLP on every rank, from one seed: each keeps its part
    single = copy.deepcopy(mlp) if args.check_single and comm.rank == 0 else None
    model = build_chain(comm, mlp, args.pipeline)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    single_optimizer = torch.optim.Adam(single.parameters(), lr=args.lr) if single is not None else None

    generator = torch.Generator().manual_seed(args.seed)
    history, start = [], time.perf_counter()
    for epoch in range(1, args.epoch + 1):
        model.train()
        loader = (
            DataLoader(train, batch_size=args.batchsize, shuffle=True, generator=generator) if comm.rank == 0 else None
        )
        n_batches = comm.bcast_obj(len(loader) if comm.rank == 0 else None)
        batches = iter(loader) if comm.rank == 0 else None
        loss_sum = 0.0
        for _ in range(n_batches):
            optimizer.zero_grad()
            if comm.rank == 0:
                x, t = next(batches)
                loss = F.cross_entropy(model(x), t)
                loss.backward()
                loss_sum += loss.item() * len(t)
                if single is not None:
                    single_optimizer.zero_grad()
                    F.cross_entropy(single(x), t).backward()
                    single_optimizer.step()
            else:
                model().backward()  # backprop from the delegate variable: this rank's part of backward
            optimizer.step()
        accuracy = evaluate(comm, model, test)
        if comm.rank == 0:
            entry = {
                "epoch": epoch,
                "train/loss": loss_sum / len(train),
                "test/accuracy": accuracy,
                "elapsed": time.perf_counter() - start,
            }
            line = f"epoch {epoch}  train/loss {entry['train/loss']:.4f}  test/accuracy {accuracy:.4f}"
            if single is not None:
                single.eval()
                with torch.no_grad():
                    x, t = test.tensors
                    entry["single/accuracy"] = (single(x).argmax(1) == t).float().mean().item()
                line += f"  single-process test/accuracy {entry['single/accuracy']:.4f}"
            history.append(entry)
            print(line + f"  elapsed {entry['elapsed']:.1f}s", flush=True)

    if comm.rank == 0:
        final = history[-1]
        print(f"final test accuracy: {final['test/accuracy']:.4f}", flush=True)
        if args.out is not None:
            write_json_atomically(
                args.out,
                {
                    "world_size": comm.size,
                    "transport": torch_chainermn.transport(comm.group),
                    "micro_batches": args.pipeline,
                    "epochs": args.epoch,
                    "final_accuracy": final["test/accuracy"],
                    "single_accuracy": final.get("single/accuracy"),
                    "history": history,
                },
            )
    torch_chainermn.functions.drain(comm)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
