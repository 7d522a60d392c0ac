"""Iterators that give several ranks the same batches (model parallelism, ChainerMN's iterators).

Two ways, as in ChainerMN:
- `create_multi_node_iterator`: one rank (the master) loads, and broadcasts every batch. The others
  need no data at all. Costs a broadcast per batch.
- `create_synchronized_iterator`: every rank loads its own copy of the data, and the ranks agree
  once on a seed so that they shuffle (and augment, in DataLoader workers) the same way. Costs one
  collective, then nothing.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

from ._backend import group_of
from .messages.framing import DEFAULT_MAX_BUF_LEN, check_rank
from .messages.objects import agree, bcast_object

__all__ = ["MultiNodeIterator", "create_multi_node_iterator", "create_synchronized_iterator"]


_BATCH, _END = "batch", "end"


class MultiNodeIterator:
    """Batches drawn on the master rank and broadcast to every rank of the group.

    Iterating it is collective: every rank must iterate it in step (same number of `next` calls).
    Each `iter()` starts a new pass over the master's iterable (an epoch of a DataLoader); the pass
    ends with StopIteration on every rank at the same call. Batches may be any picklable structure
    (tuples, lists, dicts, dataclasses) of tensors, numpy arrays and Python values; tensors and arrays
    arrive with their exact dtype, shape and values.
    """

    def __init__(self, iterable, group, rank_master: int, length):
        self._group = group
        self._rank_master = rank_master
        self._is_master = dist.get_rank(group) == rank_master
        self._iterable = iterable if self._is_master else None
        self._iterator = None
        self._exhausted = False
        self._length = length

    def __iter__(self):
        self._iterator = iter(self._iterable) if self._is_master else None
        self._exhausted = False
        return self

    def __next__(self):
        if self._exhausted:  # every rank saw the same end: no need to ask the master again
            raise StopIteration
        op = "MultiNodeIterator.__next__"
        message, failure = None, None
        if self._is_master:
            try:
                if self._iterator is None:  # next() without iter(): start the first pass
                    self._iterator = iter(self._iterable)
                message = (_BATCH, next(self._iterator))
            except StopIteration:
                message = (_END, None)
            except Exception as error:  # noqa: BLE001  the others must not wait for a batch that never comes
                failure = error
        kind, batch = bcast_object(self._group, message, self._rank_master, DEFAULT_MAX_BUF_LEN, op, failure)
        if kind == _END:
            self._exhausted = True
            self._iterator = None
            raise StopIteration
        return batch

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("the master's iterable has no len()")
        return self._length

    @property
    def is_master(self) -> bool:
        return self._is_master


def create_multi_node_iterator(iterable, comm=None, rank_master: int = 0) -> MultiNodeIterator:
    """Share the master's batches with every rank (ChainerMN's create_multi_node_iterator).

    iterable: on `rank_master`, what batches are drawn from (a DataLoader, a list, a generator);
        ignored on the other ranks (pass None).
    comm: a torch_chainermn Communicator, a ProcessGroup, or None for the default group.

    Collective: every rank must call it, and then iterate the result in step. `len()` is the master's
    len(iterable) where it has one. Unlike ChainerMN, batches are not converted to float32: any
    dtype and any nesting arrives exactly.
    """
    op = "create_multi_node_iterator"
    group = group_of(comm, op)
    rank_master = check_rank(op, "rank_master", rank_master, dist.get_world_size(group))
    failure, length = None, None
    if dist.get_rank(group) == rank_master:
        if not hasattr(iterable, "__iter__"):
            failure = ValueError(f"{op}: the master's iterable must be iterable, got {type(iterable).__name__}")
        else:
            try:
                length = len(iterable)
            except TypeError:  # no len(): a generator or an iterable-style dataset
                length = None
    # Every rank learns the length, and whether the master's iterable is usable, at creation.
    length = bcast_object(group, length, rank_master, DEFAULT_MAX_BUF_LEN, op, failure)
    return MultiNodeIterator(iterable, group, rank_master, length)


# ---- synchronized shuffling -----------------------------------------------------------------------


def _check_seed(op: str, seed):
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise ValueError(f"{op}: seed must be None or an int in [0, 2**63), got {seed!r}")
    return int(seed)


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _synchronize_sampler(sampler, seed: int) -> None:
    """Make a sampler draw the same order on every rank."""
    if isinstance(sampler, DistributedSampler):
        sampler.seed = seed  # it shuffles with seed + epoch; the ranks then take their own slices
    elif hasattr(sampler, "generator"):  # RandomSampler, SubsetRandomSampler, WeightedRandomSampler
        sampler.generator = _generator(seed)
    inner = getattr(sampler, "sampler", None)  # BatchSampler and other wrappers
    if isinstance(inner, Sampler) and inner is not sampler:
        _synchronize_sampler(inner, seed)


def _synchronize_loader(loader: DataLoader, seed: int) -> None:
    for sampler in {id(s): s for s in (loader.sampler, loader.batch_sampler) if s is not None}.values():
        _synchronize_sampler(sampler, seed)
    # The loader's generator seeds its workers (random augmentation): the same on every rank too.
    loader.generator = _generator(seed + 1)


def create_synchronized_iterator(iterable_or_dataset, comm=None, *, seed=None, root: int = 0, **loader_kwargs):
    """Make every rank's data loading shuffle the same way (ChainerMN's create_synchronized_iterator).

    The ranks agree on one seed (`root`'s: its `seed` argument, or fresh randomness when None; the
    global RNGs are left untouched), then:
    - a DataLoader is changed in place and returned: its sampler(s) draw from a generator seeded with
      the agreed seed (RandomSampler and the other samplers with a `generator`; a DistributedSampler
      gets it as its `seed`), and its own generator, which seeds worker processes (and so random
      augmentation there), is seeded from it too;
    - a Sampler is changed in place and returned;
    - a map-style dataset (len() and indexing) gets a new DataLoader(dataset, shuffle=True,
      **loader_kwargs) with a generator from the agreed seed.
    As long as every rank iterates the result the same number of times, every epoch's order is the
    same on every rank, with no communication after this call. Each rank must load its own copy of
    the data (use create_multi_node_iterator when only one rank has it).

    Collective over `comm` (a torch_chainermn Communicator, a ProcessGroup, or None for the default
    group); a mistake on any rank raises ValueError on every rank.
    """
    op = "create_synchronized_iterator"
    group = group_of(comm, op)
    root = check_rank(op, "root", root, dist.get_world_size(group))

    def propose():
        # Checked before the seed is agreed, so a mistake on one rank stops them all.
        target = iterable_or_dataset
        if isinstance(target, (DataLoader, Sampler)):
            if loader_kwargs:
                raise ValueError(
                    f"{op}: DataLoader arguments {sorted(loader_kwargs)} only apply to a dataset, "
                    f"not to a {type(target).__name__}"
                )
        elif isinstance(target, IterableDataset) or not (hasattr(target, "__len__") and hasattr(target, "__getitem__")):
            raise ValueError(
                f"{op}: expected a DataLoader, a Sampler or a map-style dataset (len() and indexing), "
                f"got {type(target).__name__}"
            )
        elif "generator" in loader_kwargs:
            raise ValueError(f"{op}: generator is set from the agreed seed; do not pass one")
        mine = _check_seed(op, seed)
        return mine if mine is not None else int.from_bytes(os.urandom(8), "little") >> 1

    agreed = agree(group, propose)[root]
    target = iterable_or_dataset
    if isinstance(target, DataLoader):
        _synchronize_loader(target, agreed)
        return target
    if isinstance(target, Sampler):
        _synchronize_sampler(target, agreed)
        return target
    loader_kwargs.setdefault("shuffle", True)
    return DataLoader(target, generator=_generator(agreed), **loader_kwargs)
