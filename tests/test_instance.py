"""The instance protocol (torch_chainermn/_instance.py) on one in-process store, ranks as threads: in
whatever order the ranks of an instance arrive, and whatever earlier instances left in the store, they
agree on one new instance; a rank that never comes is named."""
import datetime
import threading

import pytest
import torch.distributed as dist

from torch_chainermn._instance import instance_store

TIMEOUT = datetime.timedelta(seconds=10)


def new_store():
    store = dist.HashStore()
    store.set_timeout(TIMEOUT)  # a get that would wait forever fails the test instead
    return store


def create(store, size, ranks=None, delays=None, timeout=TIMEOUT):
    """Run instance_store on `ranks` (all by default) as threads, rank r after delays[r] seconds;
    {rank: instance number or the exception}."""
    ranks = range(size) if ranks is None else ranks
    outcome = {}
    barrier = threading.Event()

    def rank_body(rank):
        barrier.wait()
        if delays and delays.get(rank):
            threading.Event().wait(delays[rank])
        try:
            scoped, instance = instance_store(store, rank, size, timeout)
            scoped.set("probe", str(rank))  # lands under the instance's own prefix
            outcome[rank] = instance
        except Exception as error:  # noqa: BLE001
            outcome[rank] = error

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    barrier.set()
    for t in threads:
        t.join(30)
    return outcome


def test_every_instance_is_new_whoever_comes_first():
    store = new_store()
    seen = []
    # Rank 0 first, last, and in the middle; each instance finds the requests and answers of the ones
    # before it in the store (as torchrun's restarted attempts do).
    for delays in ({}, {0: 0.3}, {1: 0.3}, {0: 0.2, 2: 0.4}, {}):
        outcome = create(store, 3, delays=delays)
        assert len(set(outcome.values())) == 1, outcome  # one instance, agreed by all
        (instance,) = set(outcome.values())
        assert isinstance(instance, str) and instance not in seen, (instance, seen)
        seen.append(instance)
        assert store.get(f"chainermn/instance/{instance}/probe") in (b"0", b"1", b"2")


def test_an_instance_whose_rank_died_is_not_met_by_the_next():
    store = new_store()
    # An earlier instance: rank 1 asked, rank 0 never answered (it died), rank 2 never came.
    dead = create(store, 3, ranks=[1], timeout=datetime.timedelta(seconds=0.3))
    assert isinstance(dead[1], dist.DistStoreError) and "no answer from rank 0" in str(dead[1])
    outcome = create(store, 3, delays={0: 0.2})
    assert len(set(outcome.values())) == 1 and not isinstance(outcome[0], Exception), outcome


def test_a_rank_that_never_comes_is_named():
    outcome = create(new_store(), 3, ranks=[0, 1], timeout=datetime.timedelta(seconds=0.5))
    assert isinstance(outcome[0], dist.DistStoreError), outcome
    assert "ranks [2] of 3 did not join" in str(outcome[0])
    assert not isinstance(outcome[1], Exception)  # it got its answer; rank 2 is the one missing
