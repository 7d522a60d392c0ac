"""ChainerMN's MNIST tutorial as a plain PyTorch data-parallel script.

Each process trains a replica of the tutorial's MLP on its own shard of the training set;
DistributedDataParallel averages the gradients over the "chainermn" backend, as ChainerMN's
multi-node optimizer did. Launch it with either of:

    torchrun --nproc-per-node 4 examples/mnist/train_mnist.py
    mpiexec -n 4 python examples/mnist/train_mnist.py

(as root, mpiexec also needs --allow-run-as-root, and --oversubscribe for more ranks than cores).
Under mpiexec, `import torch_chainermn` fills in RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from
MPI, so both launches use the same `dist.init_process_group` call.

With --data-dir DIR the script reads the standard MNIST IDX files from DIR (optionally gzipped).
Without it, it uses scikit-learn's bundled 8x8 handwritten digits, so it runs with no download.
Pass --backend gloo to compare against torch's own backend. With the chainermn backend,
--compress fp16|bf16 sends the gradients in 16 bits and --double-buffering overlaps each step's
allreduce with the next step (ChainerMN's double buffering: the update is one step stale).
--compression 2bit|1bit compresses the gradients between nodes as MXNet does (2 bits a value with
--threshold, or the sign and a scale), keeping what was not sent for later steps; with one node there
is nothing to compress (CHAINERMN_RANKS_PER_NODE=2 makes 4 processes two simulated nodes).
"""

import argparse
import gzip
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torch_chainermn  # registers the "chainermn" backend
from torch_chainermn import hooks

WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args():
    parser = argparse.ArgumentParser(description="ChainerMN example: MNIST with DistributedDataParallel")
    parser.add_argument("--backend", default="chainermn", help="torch.distributed backend (default: chainermn)")
    parser.add_argument("--batchsize", "-b", type=int, default=100, help="minibatch size per process")
    parser.add_argument("--epoch", "-e", type=int, default=20, help="number of sweeps over the training set")
    parser.add_argument("--unit", "-u", type=int, default=1000, help="number of units in each hidden layer")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, the shuffling and the digits split")
    parser.add_argument("--data-dir", type=Path, help="directory holding the MNIST IDX files (default: sklearn digits)")
    parser.add_argument("--out", type=Path, help="rank 0 writes a JSON summary of the run here")
    parser.add_argument(
        "--compress",
        choices=sorted(WIRE_DTYPES),
        default="none",
        help="dtype of the gradients on the wire (chainermn backend only)",
    )
    parser.add_argument(
        "--compression",
        choices=("none", "2bit", "1bit"),
        default="none",
        help="MXNet's gradient compression between nodes (chainermn backend only)",
    )
    parser.add_argument("--threshold", type=float, default=0.5, help="2-bit compression's threshold")
    parser.add_argument(
        "--double-buffering",
        action="store_true",
        help="apply the previous step's mean gradient while this step's allreduce runs",
    )
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------- data


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (the format MNIST is distributed in), gzipped or not."""
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = data[0] << 8 | data[1], data[2], data[3]
    if zero != 0 or dtype_code != 0x08:  # MNIST only uses unsigned bytes
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_mnist(directory: Path):
    def split(prefix):
        images = read_idx(directory / f"{prefix}-images-idx3-ubyte")
        labels = read_idx(directory / f"{prefix}-labels-idx1-ubyte")
        return images.reshape(len(images), -1).astype(np.float32) / 255.0, labels.astype(np.int64)

    return split("train"), split("t10k")


def load_digits(seed: int, test_fraction: float = 0.2):
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = digits.data.astype(np.float32) / 16.0  # pixel values are 0..16
    labels = digits.target.astype(np.int64)
    # Every rank computes the same permutation, so they all agree on which samples are test samples.
    order = np.random.RandomState(seed).permutation(len(labels))
    n_test = int(len(labels) * test_fraction)
    train, test = order[:-n_test], order[-n_test:]
    return (images[train], labels[train]), (images[test], labels[test])


def to_dataset(split) -> TensorDataset:
    images, labels = split
    return TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))


# ---------------------------------------------------------------------------------------------- model


class MLP(nn.Module):
    """The tutorial's network: two hidden ReLU layers of n_units each."""

    def __init__(self, n_in: int, n_units: int, n_out: int = 10):
        super().__init__()
        self.l1 = nn.Linear(n_in, n_units)
        self.l2 = nn.Linear(n_units, n_units)
        self.l3 = nn.Linear(n_units, n_out)

    def forward(self, x):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        return self.l3(h)


# ---------------------------------------------------------------------------------------------- training


def train_one_epoch(model, loader, optimizer):
    """Train on this rank's shard; return the training loss averaged over every rank's samples."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64)  # [loss_sum, count]
    for x, t in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), t)
        loss.backward()  # DDP all-reduces the gradients during backward
        optimizer.step()
        totals += torch.tensor([loss.item() * len(t), len(t)], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def evaluate(model, loader):
    """Evaluate on this rank's shard of the test set; return (loss, accuracy) over the whole test set."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # [loss_sum, correct, count]
    for x, t in loader:
        y = model(x)
        totals += torch.tensor(
            [F.cross_entropy(y, t, reduction="sum").item(), (y.argmax(1) == t).sum().item(), len(t)],
            dtype=torch.float64,
        )
    # Summing the three counts (rather than averaging per-rank means) weights each rank by its shard size.
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


def write_json_atomically(path: Path, payload) -> None:
    # A temporary file in the same directory, then os.replace: readers never see a half-written file.
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(temporary, path)


def register_comm_hook(model, args):
    """The chainermn DDP hook the flags ask for; returns the double-buffering state, if any."""
    wire_dtype = WIRE_DTYPES[args.compress]
    compression = args.compression != "none"
    if (wire_dtype is not None or compression or args.double_buffering) and args.backend != "chainermn":
        raise SystemExit("--compress, --compression and --double-buffering need --backend chainermn")
    if compression and wire_dtype is not None:
        raise SystemExit("--compression and --compress are alternatives")
    if compression:
        state = hooks.GradientCompressionState(code=args.compression, threshold=args.threshold)
        if not args.double_buffering:
            model.register_comm_hook(state, hooks.gradient_compression_hook)
            return None
        wire_dtype = state
    if args.double_buffering:
        state = hooks.DoubleBufferingState(compression=wire_dtype)
        model.register_comm_hook(state, hooks.double_buffering_hook)
        return state
    if wire_dtype is not None:
        hook = hooks.fp16_compress_hook if wire_dtype == torch.float16 else hooks.bf16_compress_hook
        model.register_comm_hook(None, hook)
    return None


def main():
    args = parse_args()
    # Several ranks share few cores: one intra-op thread each avoids oversubscribing them.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    transport = torch_chainermn.transport() if args.backend == "chainermn" else None
    if rank == 0:
        print(
            f"world size: {world_size}  backend: {args.backend}" + (f"  transport: {transport}" if transport else ""),
            flush=True,
        )

    if args.data_dir is not None:
        train_split, test_split = load_mnist(args.data_dir)
    else:
        train_split, test_split = load_digits(args.seed)
    train_set, test_set = to_dataset(train_split), to_dataset(test_split)
    if rank == 0:
        source = args.data_dir or "sklearn digits"
        print(
            f"data: {source}  train: {len(train_set)}  test: {len(test_set)}  "
            f"batch size: {args.batchsize} per rank, {args.batchsize * world_size} in all",
            flush=True,
        )

    # The sampler pads the shards to equal length, so every rank runs the same number of steps,
    # which DDP needs: each step's gradient all-reduce is a collective over all ranks.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batchsize, sampler=train_sampler)
    # For evaluation, a strided split instead: no padding, so no test sample is counted twice.
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))
    test_loader = DataLoader(test_shard, batch_size=args.batchsize)

    # Same seed everywhere; DDP also broadcasts rank 0's parameters when it wraps the model.
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(MLP(train_set.tensors[0].shape[1], args.unit))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    double_buffering = register_comm_hook(model, args)

    history = []
    start = time.perf_counter()
    for epoch in range(1, args.epoch + 1):
        train_sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        train_loss = train_one_epoch(model, train_loader, optimizer)
        test_loss, test_accuracy = evaluate(model, test_loader)
        elapsed = time.perf_counter() - start
        history.append(
            {
                "epoch": epoch,
                "train/loss": train_loss,
                "test/loss": test_loss,
                "test/accuracy": test_accuracy,
                "elapsed": elapsed,
            }
        )
        if rank == 0:
            print(
                f"epoch {epoch}  train/loss {train_loss:.4f}  test/loss {test_loss:.4f}  "
                f"test/accuracy {test_accuracy:.4f}  elapsed {elapsed:.1f}s",
                flush=True,
            )

    if double_buffering is not None:
        double_buffering.flush()
    final_accuracy = history[-1]["test/accuracy"] if history else float("nan")
    if rank == 0:
        print(f"final test accuracy: {final_accuracy:.4f}", flush=True)
        if args.out is not None:
            write_json_atomically(
                args.out,
                {
                    "world_size": world_size,
                    "backend": args.backend,
                    "transport": transport,
                    "epochs": args.epoch,
                    "compress": args.compress,
                    "compression": args.compression,
                    "threshold": args.threshold,
                    "double_buffering": args.double_buffering,
                    "final_accuracy": final_accuracy,
                    "history": history,
                },
            )

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
