"""The instance protocol (torch_chainermn/_instance.py) on one in-process store, ranks as threads: in
whatever order the ranks of an instance arrive, and whatever earlier instances left in the store, they
agree on one new instance; a rank that never comes is named."""

import datetime
import threading

import torch.distributed as dist

from torch_chainermn._instance import instance_store

TIMEOUT = datetime.timedelta(seconds=10)


class ArrivalStore(dist.Store):
    """An in-process store that says when each rank of an instance has come: rank 0 once it took the
    instance's number from the counter, another rank once it posted its request. Every call goes to
    the real HashStore; only those two are watched."""

    def __init__(self):
        super().__init__()
        self.store = dist.HashStore()
        self.store.set_timeout(TIMEOUT)  # a get that would wait forever fails the test instead
        self.arrived = {}  # rank -> threading.Event, made anew for each instance (create())

    def set(self, key, value):
        self.store.set(key, value)
        if key.startswith("chainermn/request/"):
            self.arrived[int(key.rsplit("/", 1)[1])].set()

    def add(self, key, value):
        number = self.store.add(key, value)
        if key == "chainermn/instances":
            self.arrived[0].set()
        return number

    def get(self, key):
        return self.store.get(key)

    def check(self, keys):
        return self.store.check(keys)

    def wait(self, keys, timeout=None):
        return self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)

    def delete_key(self, key):
        return self.store.delete_key(key)


def new_store():
    return ArrivalStore()


def create(store, size, ranks=None, after=None, timeout=TIMEOUT):
    """Run instance_store on `ranks` (all by default) as threads, each rank r only once the ranks in
    after[r] have come (ArrivalStore); {rank: instance number or the exception}."""
    ranks = range(size) if ranks is None else ranks
    after = after or {}
    store.arrived = {rank: threading.Event() for rank in range(size)}
    outcome = {}

    def rank_body(rank):
        for earlier in after.get(rank, ()):
            assert store.arrived[earlier].wait(TIMEOUT.total_seconds()), f"rank {earlier} never came"
        try:
            scoped, instance = instance_store(store, rank, size, timeout)
            scoped.set("probe", str(rank))  # lands under the instance's own prefix
            outcome[rank] = instance
        except Exception as error:  # noqa: BLE001
            outcome[rank] = error

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    hung = [rank for rank, t in zip(ranks, threads) if t.is_alive()]
    assert not hung, f"ranks {hung} still in instance_store after 30 s"
    assert sorted(outcome) == sorted(ranks), outcome  # every rank came back with an instance or an error
    return outcome


def test_every_instance_is_new_whoever_comes_first():
    store = new_store()
    seen = []
    # Rank 0 first, last, and in the middle; each instance finds the requests and answers of the ones
    # before it in the store (as torchrun's restarted attempts do).
    for after in ({}, {0: [1, 2]}, {1: [0, 2]}, {0: [1], 2: [0]}, {}):
        outcome = create(store, 3, after=after)
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
    outcome = create(store, 3, after={0: [1, 2]})  # rank 0 last: the others' requests are new ones
    assert len(set(outcome.values())) == 1 and not isinstance(outcome[0], Exception), outcome


def test_a_rank_that_never_comes_is_named():
    outcome = create(new_store(), 3, ranks=[0, 1], timeout=datetime.timedelta(seconds=0.5))
    assert isinstance(outcome[0], dist.DistStoreError), outcome
    assert "ranks [2] of 3 did not join" in str(outcome[0])
    assert not isinstance(outcome[1], Exception)  # it got its answer; rank 2 is the one missing
