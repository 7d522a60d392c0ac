"""ChainerMN's MNIST tutorial, the ChainerMN way: communicator, scatter_dataset, multi-node optimizer,
multi-node evaluator and multi-node checkpointer (train_mnist.py is the same model as a DDP script).

    torchrun --nproc-per-node 4 examples/mnist/train_mnist_chainermn.py
    mpiexec -n 4 python examples/mnist/train_mnist_chainermn.py --communicator flat --double-buffering

(as root, mpiexec also needs --allow-run-as-root, and --oversubscribe for more ranks than cores).
The steps of the tutorial, as they appear in main():

1. `comm = torch_chainermn.create_communicator(args.communicator)`: this also initialises
   torch.distributed with the chainermn backend, under torchrun or mpiexec alike.
2. Rank 0 alone loads the data (scikit-learn's 8x8 digits, or the MNIST IDX files of --data-dir);
   `scatter_dataset` deals every rank its shard, so one epoch is one pass over the training set.
3. `create_multi_node_optimizer(torch.optim.Adam(...), comm)`: the first step() broadcasts rank 0's
   parameters, every later one averages the gradients over the ranks (in --allreduce-grad-dtype,
   with --double-buffering one step stale) and then steps Adam.
4. `create_multi_node_evaluator(evaluate, comm, weight=len(test))`: each rank evaluates its shard of
   the test set; the metrics are averaged with each rank weighted by its shard's size, which gives
   exactly the whole test set's accuracy.
5. `create_multi_node_checkpointer(name, comm, path=--checkpoint-dir)`: every rank saves model,
   optimizer and epoch after each epoch; at start `maybe_load()` resumes from the newest epoch that
   every rank saved, so a killed job is restarted with the same command. After a successful run
   `finalize()` removes the snapshots (--keep-checkpoints keeps them), then rank 0 the directories the
   run made for them (result/checkpoints under the working directory by default): a run that ends
   well leaves nothing behind.

Only rank 0 prints. --out writes a JSON summary (rank 0, atomically); `resumed_from` in it is the
epoch the run resumed from (0 for a fresh start). --die-after-epoch N is for tests: once every rank
has saved epoch N, rank 1 (rank 0 in a world of one) exits with status 1, as a killed job would.

CPU only: the backend's CUDA paths are not there yet, so every communicator but pure_nccl (which is
NCCL-only) can be chosen.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import torch_chainermn  # registers the "chainermn" backend (and, under mpiexec, reads rank and size from MPI)
from torch_chainermn.options import COMMUNICATORS

# The tutorial's model and data loaders are those of the DDP version of this example.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mnist import MLP, load_digits, load_mnist, to_dataset, write_json_atomically  # noqa: E402

CPU_COMMUNICATORS = tuple(name for name in COMMUNICATORS if name != "pure_nccl")
GRAD_DTYPES = {"none": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args():
    parser = argparse.ArgumentParser(description="ChainerMN example: MNIST, the ChainerMN way")
    parser.add_argument(
        "--communicator",
        default="hierarchical",
        choices=CPU_COMMUNICATORS,
        help="ChainerMN allreduce communicator (default: hierarchical)",
    )
    parser.add_argument(
        "--allreduce-grad-dtype",
        choices=sorted(GRAD_DTYPES),
        default="none",
        help="dtype of the gradients on the wire (default: $CHAINERMN_ALLREDUCE_GRAD_DTYPE, else their own, float32)",
    )
    parser.add_argument(
        "--double-buffering",
        action="store_true",
        help="overlap each step's gradient allreduce with the next step (one step stale)",
    )
    parser.add_argument("--batchsize", "-b", type=int, default=100, help="minibatch size per process")
    parser.add_argument("--epoch", "-e", type=int, default=20, help="number of sweeps over the training set")
    parser.add_argument("--unit", "-u", type=int, default=1000, help="number of units in each hidden layer")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, the data split and the shuffling")
    parser.add_argument("--data-dir", type=Path, help="directory holding the MNIST IDX files (default: sklearn digits)")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path("result") / "checkpoints",
        help="where every rank saves its snapshots (default: result/checkpoints)",
    )
    parser.add_argument(
        "--checkpoint-name",
        default="mnist",
        help="snapshots are <checkpoint-dir>/<name>.<rank>.<epoch> (default: mnist)",
    )
    parser.add_argument("--keep-checkpoints", action="store_true", help="do not remove the snapshots at the end")
    parser.add_argument("--out", type=Path, help="rank 0 writes a JSON summary of the run here")
    parser.add_argument(
        "--die-after-epoch",
        type=int,
        metavar="N",
        help="testing: once epoch N is saved everywhere, rank 1 exits with status 1",
    )
    return parser.parse_args()


def load_dataset(args):
    """Rank 0's (train, test) TensorDatasets."""
    if args.data_dir is not None:
        train_split, test_split = load_mnist(args.data_dir)
    else:
        train_split, test_split = load_digits(args.seed)
    return to_dataset(train_split), to_dataset(test_split)


def train_one_epoch(model, loader, optimizer):
    """Train on this rank's shard; returns (loss sum, sample count) of this rank."""
    model.train()
    loss_sum, count = 0.0, 0
    for x, t in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), t)
        loss.backward()
        optimizer.step()  # the multi-node optimizer averages the gradients over the ranks first
        loss_sum += loss.item() * len(t)
        count += len(t)
    return loss_sum, count


@torch.no_grad()
def evaluate(model, loader):
    """Loss and accuracy on this rank's shard of the test set (NaN for an empty shard: weight 0)."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, t in loader:
        y = model(x)
        loss_sum += F.cross_entropy(y, t, reduction="sum").item()
        correct += (y.argmax(1) == t).sum().item()
        count += len(t)
    if count == 0:
        return {"loss": float("nan"), "accuracy": float("nan")}
    return {"loss": loss_sum / count, "accuracy": correct / count}


def main():
    args = parse_args()
    # Several ranks share few cores: one intra-op thread each avoids oversubscribing them.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    # Step 1: the communicator (and torch.distributed's default group, with these options).
    # The checkpoint directories this run makes (result/checkpoints and result/ by default), deepest
    # first: looked at before any rank can make them (create_communicator is the first collective).
    made = [d for d in (args.checkpoint_dir, *args.checkpoint_dir.parents) if not d.exists()]
    comm = torch_chainermn.create_communicator(
        args.communicator, allreduce_grad_dtype=GRAD_DTYPES[args.allreduce_grad_dtype]
    )
    transport = torch_chainermn.transport(comm.group)
    if comm.rank == 0:
        print(
            f"world size: {comm.size}  communicator: {comm.communicator_name}  transport: {transport}  "
            f"allreduce_grad_dtype: {comm.allreduce_grad_dtype}  double buffering: {args.double_buffering}",
            flush=True,
        )

    # Step 2: rank 0 reads the data; every rank receives its shard.
    train, test = load_dataset(args) if comm.rank == 0 else (None, None)
    if comm.rank == 0:
        print(
            f"data: {args.data_dir or 'sklearn digits'}  train: {len(train)}  test: {len(test)}  "
            f"batch size: {args.batchsize} per rank, {args.batchsize * comm.size} in all",
            flush=True,
        )
    # Training shards have equal length (ceil(n/size), a few samples repeated), so every rank runs the
    # same number of steps, as the optimizer's allreduce needs. Test shards do not repeat samples: with
    # the evaluator weighting each rank by its shard's size, the result is the whole test set's.
    train = torch_chainermn.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
    test = torch_chainermn.scatter_dataset(test, comm, shuffle=True, seed=args.seed, force_equal_length=False)
    test_loader = DataLoader(test, batch_size=args.batchsize)

    torch.manual_seed(args.seed)
    model = MLP(train[0][0].numel(), args.unit)

    # Step 3: the multi-node optimizer.
    optimizer = torch_chainermn.create_multi_node_optimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr), comm, double_buffering=args.double_buffering
    )

    # Step 4: the multi-node evaluator.
    evaluator = torch_chainermn.create_multi_node_evaluator(
        lambda: evaluate(model, test_loader), comm, weight=len(test)
    )

    # Step 5: the multi-node checkpointer; resume if every rank has a snapshot.
    checkpointer = torch_chainermn.create_multi_node_checkpointer(args.checkpoint_name, comm, path=args.checkpoint_dir)
    state, resumed_from = checkpointer.maybe_load()
    history = []
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        history = state["history"]
        resumed_from = state["epoch"]
        if comm.rank == 0:
            print(f"resumed from epoch {resumed_from} ({checkpointer.filename(resumed_from)})", flush=True)

    start = time.perf_counter() - (history[-1]["elapsed"] if history else 0.0)
    for epoch in range(resumed_from + 1, args.epoch + 1):
        # A shuffle of this rank's shard that depends only on (seed, rank, epoch): a resumed run
        # draws the batches the uninterrupted run would have drawn.
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + comm.rank * 10_007 + epoch)
        loader = DataLoader(train, batch_size=args.batchsize, shuffle=True, generator=generator)
        loss_sum, count = train_one_epoch(model, loader, optimizer)
        totals = comm.allreduce(np.array([loss_sum, count], dtype=np.float64))
        metrics = evaluator()
        elapsed = time.perf_counter() - start
        history.append(
            {
                "epoch": epoch,
                "train/loss": float(totals[0] / totals[1]),
                "test/loss": metrics["loss"],
                "test/accuracy": metrics["accuracy"],
                "elapsed": elapsed,
            }
        )
        if comm.rank == 0:
            print(
                f"epoch {epoch}  train/loss {history[-1]['train/loss']:.4f}  test/loss {metrics['loss']:.4f}  "
                f"test/accuracy {metrics['accuracy']:.4f}  elapsed {elapsed:.1f}s",
                flush=True,
            )

        if args.double_buffering:
            optimizer.flush()  # no allreduce in flight while saving (its mean is applied next step)
        checkpointer.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "history": history},
            epoch,
        )
        if epoch == args.die_after_epoch:
            dist.barrier(group=comm.group)  # every rank's snapshot of this epoch is on disk
            if comm.rank == min(1, comm.size - 1):
                print(f"rank {comm.rank}: dying after epoch {epoch} (--die-after-epoch)", file=sys.stderr, flush=True)
                os._exit(1)

    if not args.keep_checkpoints:
        checkpointer.finalize()  # collective: no rank deletes its snapshots before all got here
        dist.barrier(group=comm.group)  # every rank's snapshots are gone
        if comm.rank == 0:
            for directory in made:
                directory.rmdir()
    final_accuracy = history[-1]["test/accuracy"] if history else float("nan")
    if comm.rank == 0:
        print(f"final test accuracy: {final_accuracy:.4f}", flush=True)
        if args.out is not None:
            write_json_atomically(
                args.out,
                {
                    "world_size": comm.size,
                    "communicator": comm.communicator_name,
                    "transport": transport,
                    "allreduce_grad_dtype": str(comm.allreduce_grad_dtype).removeprefix("torch.").lower(),
                    "double_buffering": args.double_buffering,
                    "epochs": args.epoch,
                    "resumed_from": resumed_from,
                    "final_accuracy": final_accuracy,
                    "history": history,
                },
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
