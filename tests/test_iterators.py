"""Multi-node iterator (the master broadcasts batches) and synchronized iterator (a shared seed)."""

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from torch_chainermn.communicator import Communicator
from torch_chainermn.iterators import create_multi_node_iterator, create_synchronized_iterator
from tests.support.harness import run_spawn


@dataclasses.dataclass
class Labelled:
    label: str
    scores: torch.Tensor


def batch(i):
    """Nested, of every kind: values float32 could not hold (ChainerMN's iterator lost them)."""
    return {
        "x": torch.arange(6, dtype=torch.float64).reshape(2, 3) + i / 3,
        "y": torch.tensor([i, -i], dtype=torch.int64) * 2**40 + 1,
        "mask": torch.tensor([True, i % 2 == 0]),
        "half": torch.full((2,), 0.1 * i, dtype=torch.bfloat16),
        "scalar": torch.tensor(i, dtype=torch.int32),
        "view": (torch.arange(12.0).reshape(3, 4) + i).t(),
        "numpy": np.arange(3, dtype=np.uint16) + i,
        "meta": (f"item-{i}", i, [None, 1.5, {"deep": np.float32(i)}]),
        "record": Labelled(f"r{i}", torch.ones(2) * i),
    }


def assert_exact(actual, expected, where="batch"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape and torch.equal(actual, expected), where
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, where
        assert np.array_equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_exact(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_exact(a, e, f"{where}[{i}]")
    elif dataclasses.is_dataclass(expected):
        assert type(actual) is type(expected), where
        for field in dataclasses.fields(expected):
            assert_exact(getattr(actual, field.name), getattr(expected, field.name), f"{where}.{field.name}")
    else:
        assert type(actual) is type(expected) and actual == expected, where


class Broken:
    """An iterable whose third batch fails to load."""

    def __iter__(self):
        yield batch(0)
        yield batch(1)
        raise OSError("disk gone at batch 2")


def check_multi_node(comm):
    rank, size = comm.rank, comm.size
    master = size - 1
    it = create_multi_node_iterator([batch(i) for i in range(5)] if rank == master else None, comm, rank_master=master)
    assert len(it) == 5 and it.is_master == (rank == master)
    for _ in range(2):  # two epochs: each iter() is a new pass on every rank
        count = 0
        for i, got in enumerate(it):
            assert_exact(got, batch(i))
            count += 1
        assert count == 5
        with pytest.raises(StopIteration):  # stays ended, on every rank, without talking
            next(it)
    # A generator (no len) on the master; the group as a ProcessGroup; next() without iter().
    gen = create_multi_node_iterator((batch(i) for i in range(3)) if rank == 0 else None, comm.group)
    with pytest.raises(TypeError):
        len(gen)
    assert_exact(next(gen), batch(0))
    assert [b["scalar"].item() for b in gen] == [1, 2]
    # A shuffling DataLoader on the master: everyone sees the master's draw, not their own.
    torch.manual_seed(rank)
    loader = DataLoader(torch.arange(20), batch_size=6, shuffle=True) if rank == 0 else None
    shared = [b.tolist() for b in create_multi_node_iterator(loader, None)]
    # A failure on the master reaches every rank; afterwards the group still works.
    failing = create_multi_node_iterator(Broken() if rank == 0 else None, comm)
    got = []
    with pytest.raises(OSError if rank == 0 else RuntimeError, match="disk gone"):
        for b in failing:
            got.append(b["scalar"].item())
    assert got == [0, 1]
    with pytest.raises(ValueError, match="iterable"):
        create_multi_node_iterator(42 if rank == 0 else None, comm)
    with pytest.raises(ValueError, match="rank_master"):
        create_multi_node_iterator([], comm, rank_master=size)
    return shared


def epoch_orders(loader, epochs=2):
    return [[int(i) for b in loader for i in b] for _ in range(epochs)]


class Noisy(torch.utils.data.Dataset):
    """Random values drawn in the worker process: the same on every rank only if worker seeds are."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.rand(())


def check_synchronized(comm):
    rank = comm.rank
    torch.manual_seed(100 + rank)  # every rank's own RNG differs: only the agreed seed aligns them
    dataset = list(range(24))
    outcome = {}
    outcome["dataset"] = epoch_orders(create_synchronized_iterator(dataset, comm, batch_size=5))
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    outcome["unsynchronized"] = epoch_orders(loader, 1)
    assert create_synchronized_iterator(loader, comm) is loader  # changed in place
    outcome["loader"] = epoch_orders(loader)
    sampler = create_synchronized_iterator(RandomSampler(dataset), comm.group)
    outcome["sampler"] = [list(sampler), list(sampler)]
    distributed = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True)
    create_synchronized_iterator(DataLoader(dataset, sampler=distributed), None)
    outcome["distributed"] = list(distributed)
    # The root's seed wins, and gives what torch's own idiom with that seed gives.
    explicit = create_synchronized_iterator(dataset, comm, seed=5 if rank == 0 else 9, batch_size=24)
    outcome["explicit"] = epoch_orders(explicit, 1)[0]
    idiom = DataLoader(dataset, batch_size=24, shuffle=True, generator=torch.Generator().manual_seed(5))
    assert outcome["explicit"] == epoch_orders(idiom, 1)[0]
    # Worker processes are seeded from the agreed seed too.
    # fork: a spawned worker would re-import torch, seconds on a busy machine.
    workers = create_synchronized_iterator(
        DataLoader(Noisy(), batch_size=4, num_workers=1, multiprocessing_context="fork"), comm
    )
    outcome["workers"] = [b.tolist() for b in workers]
    # Mistakes on any rank stop every rank.
    with pytest.raises(ValueError, match="map-style"):
        create_synchronized_iterator(iter(dataset) if rank == 0 else dataset, comm)
    with pytest.raises(ValueError, match="batch_size"):
        create_synchronized_iterator(loader, comm, batch_size=3)
    with pytest.raises(ValueError, match="seed"):
        create_synchronized_iterator(dataset, comm, seed=-1)
    return outcome


def iterator_cases():
    comm = Communicator()
    return check_multi_node(comm), check_synchronized(comm)


def check_results(results, size):
    shared = [r[0] for r in results]
    assert all(s == shared[0] for s in shared) and sorted(sum(shared[0], [])) == list(range(20))
    synced = [r[1] for r in results]
    for key in ["dataset", "loader", "sampler", "distributed", "explicit", "workers"]:
        assert all(s[key] == synced[0][key] for s in synced), f"{key} differs between ranks"
    for key in ["dataset", "loader", "sampler"]:
        first, second = synced[0][key]
        assert sorted(first) == list(range(24)) and first != second, f"{key}: not a fresh shuffle per epoch"
    assert len(set(tuple(s["unsynchronized"][0]) for s in synced)) == size, "the ranks' own RNGs did not differ"


def test_iterators_over_gloo():
    # Iterators only use the communicator's broadcast, which test_communicator runs over MPI too.
    check_results(run_spawn(iterator_cases, 3, timeout=300, op_timeout=120), 3)
