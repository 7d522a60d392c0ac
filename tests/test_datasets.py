"""scatter_dataset and create_empty_dataset: ChainerMN's shard properties, and that each rank is
sent its own shard only."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from torch_chainermn.communicator import Communicator
from torch_chainermn.datasets import create_empty_dataset, scatter_dataset
from tests.support.harness import run_mpiexec, run_spawn

SEED = 7
OFFSET = 1000  # sample i is OFFSET + i, so samples and positions cannot be confused


def sizes_for(size):
    return [0, 1, size, 5 * size - 1]


# ---- datasets the root may hold --------------------------------------------------------------------

PICKLED_ON_ROOT = []  # which samples the root pickled, in order


class Sample:
    """A sample that records every time it is pickled (on the root, that is what it sends)."""

    def __init__(self, index):
        self.index = index

    def __reduce__(self):
        PICKLED_ON_ROOT.append(self.index)
        return Sample, (self.index,)


class RootOnlyDataset(torch.utils.data.Dataset):
    """A dataset that cannot be pickled itself (ChainerMN pickled and broadcast the whole dataset)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return Sample(index)

    def __reduce__(self):
        raise TypeError("this dataset must not leave the root")


class Poison:
    """What non-root ranks pass: any use of it fails, so it must be ignored."""

    def __len__(self):
        raise AssertionError("a non-root rank's dataset was used")

    def __getitem__(self, index):
        raise AssertionError("a non-root rank's dataset was used")


class FailingDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        if index == 8:
            raise KeyError("sample 8 is missing")
        return index


# ---- on every rank ---------------------------------------------------------------------------------


def scatter_properties():
    """Every (n, root, shuffle, force_equal_length): this rank's (samples, indices), for the parent."""
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = Communicator()
    ways = [comm, comm.group, None]  # a Communicator, a ProcessGroup, the default group
    shards = {}
    for n in sizes_for(size):
        for root in range(size):
            for shuffle in (False, True):
                for equal in (True, False):
                    data = [OFFSET + i for i in range(n)] if rank == root else Poison()
                    how = ways[len(shards) % len(ways)]
                    shard = scatter_dataset(data, how, root=root, shuffle=shuffle, seed=SEED, force_equal_length=equal)
                    samples = [shard[i] for i in range(len(shard))]
                    shards[(n, root, shuffle, equal)] = (samples, shard.indices.tolist())
    return shards


def check_containers(rank, size):
    """numpy arrays, tensors and TensorDatasets keep their rows' dtype and shape; DataLoader works."""
    n = 5 * size - 1
    rows = np.arange(n * 3, dtype=np.int16).reshape(n, 3)
    root = size - 1
    for data in [
        rows,
        torch.from_numpy(rows.astype(np.float64)),
        torch.utils.data.TensorDataset(torch.arange(n), torch.arange(n * 2, dtype=torch.float16).reshape(n, 2)),
    ]:
        shard = scatter_dataset(
            data if rank == root else None,
            None,
            root=root,
            shuffle=True,
            seed=3,
            max_buf_len=13,
            force_equal_length=False,
        )
        for i, index in enumerate(shard.indices):
            got, want = shard[i], data[int(index)]
            if isinstance(want, tuple):
                assert all(torch.equal(g, w) for g, w in zip(got, want))
            elif isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want)
            else:
                assert got.dtype == want.dtype and np.array_equal(got, want)
    loader = torch.utils.data.DataLoader(shard, batch_size=2, shuffle=True)
    seen = sorted(int(i) for first, _ in loader for i in first)
    assert seen == sorted(int(i) for i in shard.indices)


def check_only_own_shard(rank, size):
    """The root pickles each other rank's samples once, and never the dataset or its own shard."""
    root = 0
    n = 5 * size - 1
    PICKLED_ON_ROOT.clear()
    shard = scatter_dataset(
        RootOnlyDataset(n) if rank == root else Poison(),
        Communicator(),
        root=root,
        shuffle=True,
        seed=SEED,
        force_equal_length=False,
    )
    assert [sample.index for sample in shard.items] == shard.indices.tolist()
    return shard.indices.tolist(), list(PICKLED_ON_ROOT) if rank == root else None


def check_failures(rank, size):
    comm = Communicator()
    # Bad arguments on the root reach everyone as ValueError.
    with pytest.raises(ValueError, match="dataset"):
        scatter_dataset(None, comm)
    with pytest.raises(ValueError, match="[Ss]eed"):
        scatter_dataset(list(range(5)) if rank == 0 else None, comm, shuffle=True, seed=-1)
    # A sample that fails to load: the root raises it, the others hear of it.
    with pytest.raises(KeyError if rank == 0 else RuntimeError, match="sample 8"):
        scatter_dataset(FailingDataset() if rank == 0 else None, comm)
    # Local argument checks, before any communication.
    with pytest.raises(ValueError, match="root"):
        scatter_dataset([1], comm, root=size)
    with pytest.raises(ValueError, match="max_buf_len"):
        scatter_dataset([1], comm, max_buf_len=0)
    # Nothing stale is left behind: the next scatter is right.
    shard = scatter_dataset(list(range(size)) if rank == 0 else None, comm, force_equal_length=False)
    assert len(shard) == 1 and shard[0] == rank


def check_sub_group(rank, size):
    """Ranks of a group that is not the world, in reverse order: roots and shards are group ranks."""
    sub = Communicator().split(0 if rank > 0 else None, -rank)
    if sub is None:
        return None
    data = list(range(10)) if sub.rank == 0 else None  # group rank 0 is the highest global rank
    shard = scatter_dataset(data, sub, force_equal_length=False)
    result = (sub.rank, [shard[i] for i in range(len(shard))])
    sub.finalize()
    return result


def dataset_cases():
    rank, size = dist.get_rank(), dist.get_world_size()
    check_containers(rank, size)
    own = check_only_own_shard(rank, size)
    check_failures(rank, size)
    sub = check_sub_group(rank, size)
    empty = create_empty_dataset(list(range(4)))
    assert len(empty) == 4 and [empty[i] for i in range(4)] == [()] * 4
    with pytest.raises(IndexError):
        empty[4]
    return scatter_properties(), own, sub


# ---- the parent checks the properties --------------------------------------------------------------


def check_properties(shards_per_rank, size):
    for n, root, shuffle, equal in shards_per_rank[0]:
        shards = [shards_per_rank[r][(n, root, shuffle, equal)] for r in range(size)]
        what = f"n={n} root={root} shuffle={shuffle} equal={equal}"
        order = np.random.RandomState(SEED).permutation(n).tolist() if shuffle else list(range(n))
        for samples, indices in shards:
            assert samples == [OFFSET + i for i in indices], what  # a sample is where its index says
        lengths = [len(samples) for samples, _ in shards]
        everything = [s for samples, _ in shards for s in samples]
        assert set(everything) == {OFFSET + i for i in range(n)}, f"{what}: not every sample is dealt"
        if equal:
            assert lengths == [-(-n // size)] * size, what
        else:
            assert sorted(everything) == [OFFSET + i for i in range(n)], f"{what}: duplicates"
            assert max(lengths) - min(lengths) <= 1, what
            assert lengths == [n // size + (r < n % size) for r in range(size)], what
            # Dealt in order of the (seeded, ChainerMN-compatible) permutation.
            assert [i for _, indices in shards for i in indices] == order, what
        # Shards are contiguous runs of the order, so a fixed seed always puts a sample on one rank.
        for _, indices in shards:
            if indices:
                start = order.index(indices[0])
                assert indices == order[start : start + len(indices)], what


def check_own_shard_only(owns, size):
    indices = [own[0] for own in owns]
    pickled = owns[0][1]
    sent = [i for r in range(1, size) for i in indices[r]]
    assert pickled == sent, "the root pickled more (or other) samples than the other ranks' shards"


def check_results(results, size):
    shards_per_rank = [r[0] for r in results]
    check_properties(shards_per_rank, size)
    check_own_shard_only([r[1] for r in results], size)
    subs = [r[2] for r in results]
    assert subs[0] is None
    members = list(range(size - 1, 0, -1))  # global ranks by group rank
    for rank in range(1, size):
        group_rank, samples = subs[rank]
        assert group_rank == members.index(rank)
        per = [10 // (size - 1) + (g < 10 % (size - 1)) for g in range(size - 1)]
        begin = sum(per[:group_rank])
        assert samples == list(range(begin, begin + per[group_rank]))


def test_scatter_dataset_over_gloo():
    check_results(run_spawn(dataset_cases, 3, timeout=400, op_timeout=120), 3)


@pytest.mark.mpi
def test_scatter_dataset_over_mpi():
    check_results(run_mpiexec(dataset_cases, 2, timeout=400, op_timeout=120), 2)


def test_shard_bounds_without_processes():
    from torch_chainermn.datasets import shard_bounds

    for size in range(1, 6):
        for n in range(0, 30):
            equal = shard_bounds(n, size, True)
            assert all(e - b == -(-n // size) and 0 <= b and e <= n for b, e in equal)
            dealt = shard_bounds(n, size, False)
            assert dealt[0][0] == 0 and dealt[-1][1] == n
            assert all(dealt[i][1] == dealt[i + 1][0] for i in range(size - 1))
