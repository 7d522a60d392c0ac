"""ChainerMN's dataset utilities: scatter one rank's dataset so that every rank holds its shard.

    train = torch_chainermn.scatter_dataset(train if comm.rank == 0 else None, comm, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True)

Unlike ChainerMN, which pickled and broadcast the whole dataset to every rank, the root sends each
rank only its own shard, point to point, in chunks of `max_buf_len` bytes: a rank never holds more
than its share, and shards over 2 GiB work.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ._backend import group_of
from .messages.framing import DEFAULT_MAX_BUF_LEN, TAG_SCATTER_DATASET, check_max_buf_len, check_rank
from .messages.objects import bcast_object, recv_object, send_failure, send_object


__all__ = ["ScatteredDataset", "EmptyDataset", "create_empty_dataset", "scatter_dataset"]


class ScatteredDataset(torch.utils.data.Dataset):
    """One rank's shard of a scattered dataset: `len()` items, indexed 0..len-1.

    `indices[i]` is the position in the root's dataset of item i (after shuffling), so a run can tell
    which samples each rank trained on.
    """

    def __init__(self, items, indices: np.ndarray):
        self.items = items  # a list of samples, or a tensor/array/TensorDataset of the shard's rows
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index):
        return self.items[index]

    def __repr__(self):
        return f"ScatteredDataset(len={len(self)})"


class EmptyDataset(torch.utils.data.Dataset):
    """`length` samples that are all the empty tuple: input for ranks that take none (model
    parallelism, where a rank's forward starts with a recv)."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if not -self.length <= index < self.length:
            raise IndexError(f"index {index} out of range for a dataset of {self.length}")
        return ()


def create_empty_dataset(dataset) -> EmptyDataset:
    """A dataset as long as `dataset` whose samples are empty tuples (ChainerMN's create_empty_dataset)."""
    return EmptyDataset(len(dataset))


def shard_bounds(n: int, size: int, force_equal_length: bool) -> list[tuple[int, int]]:
    """[begin, end) of each rank's shard of n samples (positions in the shuffled order).

    Equal length (ChainerMN's default): every shard has ceil(n/size) samples, shard i starting at
    n*i//size, so shards overlap by a sample where n does not divide evenly. Otherwise the first
    n % size ranks get one sample more, and every sample is on exactly one rank.
    """
    if force_equal_length:
        length = -(-n // size)
        return [(n * i // size, n * i // size + length) for i in range(size)]
    base, extra = divmod(n, size)
    begins = [i * base + min(i, extra) for i in range(size + 1)]
    return list(zip(begins[:-1], begins[1:]))


def _take(dataset, indices: np.ndarray):
    """The samples of `dataset` at `indices`, in a form that pickles compactly: rows of a tensor,
    array or TensorDataset stay one array per field; anything else becomes a list of samples."""
    if isinstance(dataset, np.ndarray):
        return dataset[indices]
    if isinstance(dataset, torch.Tensor):
        return dataset[torch.from_numpy(indices)]
    if isinstance(dataset, torch.utils.data.TensorDataset):
        rows = torch.from_numpy(indices)
        return torch.utils.data.TensorDataset(*(tensor[rows] for tensor in dataset.tensors))
    return [dataset[int(i)] for i in indices]


def _order(n: int, shuffle: bool, seed) -> np.ndarray:
    """The order samples are dealt in: ChainerMN's, numpy's RandomState(seed).permutation when
    shuffling, so a fixed seed puts every sample on the same rank as it did in ChainerMN."""
    if shuffle:
        return np.random.RandomState(seed).permutation(n).astype(np.int64)
    return np.arange(n, dtype=np.int64)


def scatter_dataset(
    dataset,
    comm=None,
    root: int = 0,
    shuffle: bool = False,
    seed=None,
    max_buf_len: int = DEFAULT_MAX_BUF_LEN,
    force_equal_length: bool = True,
) -> ScatteredDataset:
    """Deal the root's dataset out to the ranks of `comm`; every rank returns its shard.

    dataset: on `root`, anything with len() and integer indexing (a list, a numpy array, a tensor, a
        torch Dataset); ignored elsewhere (pass None).
    comm: a torch_chainermn Communicator, a ProcessGroup, or None for the default group; `root` is a
        rank of it.
    shuffle, seed: deal a permutation of the samples (numpy's RandomState(seed)); with a fixed seed
        every sample always lands on the same rank; seed=None draws a new permutation.
    max_buf_len: the largest chunk, in bytes, sent in one message.
    force_equal_length: every shard has ceil(n/size) samples (a few are repeated), so every rank runs
        the same number of iterations; False deals every sample exactly once, sizes differing by one.

    Collective over `comm`. The returned dataset supports len() and indexing and works with
    torch.utils.data.DataLoader; its `indices` say where each sample was in the root's dataset.
    """
    op = "scatter_dataset"
    group = group_of(comm, op)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    root = check_rank(op, "root", root, size)
    chunk = check_max_buf_len(op, max_buf_len)
    if rank == root:
        shard, failure = _deal(op, group, dataset, root, size, shuffle, seed, chunk, force_equal_length)
    else:
        shard, failure = _receive(op, group, root)
    # Everyone learns whether every rank got its shard, so no rank goes on to train while another
    # raised (the root says why, once).
    bcast_object(group, None, root, DEFAULT_MAX_BUF_LEN, op, failure if rank == root else None)
    if failure is not None:
        raise failure
    return shard


def _deal(op, group, dataset, root, size, shuffle, seed, chunk, force_equal_length):
    """On the root: send every other rank its shard; return (own shard, failure or None)."""
    shard, failure, pending = None, None, [r for r in range(size) if r != root]
    try:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(f"{op}: the root's dataset must support len() and indexing, got {type(dataset).__name__}")
        n = len(dataset)
        order = _order(n, shuffle, seed)
        for r, (begin, end) in enumerate(shard_bounds(n, size, force_equal_length)):
            indices = order[begin:end]
            if r == root:
                shard = ScatteredDataset(_take(dataset, indices), indices)
                continue
            # Only this shard is built and pickled now: the root holds one rank's copy at a time.
            payload = (_take(dataset, indices), indices)
            pending.remove(r)  # from here on, send_object itself tells r if pickling fails
            send_object(group, payload, r, TAG_SCATTER_DATASET, chunk, op)
    except Exception as error:  # noqa: BLE001  the ranks still waiting must hear of it
        failure = error
        for r in pending:
            send_failure(group, r, TAG_SCATTER_DATASET, op, error)
    return shard, failure


def _receive(op, group, root):
    """On another rank: (own shard, failure or None)."""
    try:
        items, indices = recv_object(group, root, TAG_SCATTER_DATASET, op)
    except (ValueError, RuntimeError) as error:
        return None, error
    return ScatteredDataset(items, indices), None
