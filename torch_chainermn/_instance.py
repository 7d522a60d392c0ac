"""One key space in the c10d store for each instance of a group, agreed by its ranks.

Everything a chainermn group writes to the store (the transport vote, host names, shared-memory segment
names, NCCL ids, inner Gloo groups) goes under `chainermn/instance/<n>/`, where <n> is new for every
instance of the group. Without that, a group finds the keys of an earlier one and uses them:

- torchrun's restarts: the agent hosts the store and keeps it from one attempt to the next (torch 2.13
  shares the rendezvous TCPStore with the workers and gives them no per-attempt prefix; pytorch#135712),
  so attempt 1 reads attempt 0's segment names and Gloo addresses and fails or hangs;
- a group destroyed and created again in the same processes: torch names it the same ("0" for the
  default group after destroy_process_group) and hands it the same prefix.

Nothing every rank knows is new per instance (TORCHELASTIC_RESTART_COUNT is kept by each node's agent
and differs between nodes), and a value published under a fixed key may be an earlier instance's. So:
rank 0 takes <n> from an atomic counter (never handed out twice by one store), and every other rank
asks for it under a key of its own making that no earlier instance can have written (a random nonce),
then confirms under <n>. Rank 0 answers each request it sees, old ones included (harmless: nobody
waits for those answers), until every rank has confirmed.
"""

import datetime
import time
import uuid

import torch.distributed as dist

_COUNTER = "chainermn/instances"


def _request_key(rank: int) -> str:
    return f"chainermn/request/{rank}"


def _answer_key(nonce: str) -> str:
    return f"chainermn/answer/{nonce}"


def _joined_key(instance: str, rank: int) -> str:
    return f"chainermn/instance/{instance}/joined/{rank}"


def _serve(store, size: int, instance: str, timeout: datetime.timedelta) -> None:
    """Rank 0: answer the other ranks' requests with `instance` until all have confirmed it."""
    pending = set(range(1, size))
    answered = {}  # rank -> the nonce last answered
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.0005
    while pending:
        if store.check([_joined_key(instance, r) for r in pending]):
            return
        for r in sorted(pending):
            if store.check([_joined_key(instance, r)]):
                pending.discard(r)
            elif store.check([_request_key(r)]):
                nonce = store.get(_request_key(r)).decode()
                if answered.get(r) != nonce:
                    store.set(_answer_key(nonce), instance)
                    answered[r] = nonce
        if pending and time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"chainermn: creating a group (instance {instance}): ranks {sorted(pending)} of {size} did not "
                f"join within {timeout.total_seconds():.0f} s"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def instance_store(store, rank: int, size: int, timeout: datetime.timedelta):
    """The store `store` scoped to this instance of the group, and the instance's number (a string).

    A collective over the group's ranks: every rank calls it once per group it creates."""
    if rank == 0:
        instance = str(store.add(_COUNTER, 1))
        _serve(store, size, instance, timeout)
    else:
        nonce = uuid.uuid4().hex
        store.set(_request_key(rank), nonce)
        try:
            store.wait([_answer_key(nonce)], timeout)
        except dist.DistStoreError as error:
            raise dist.DistStoreError(
                f"chainermn: creating a group: rank {rank} of {size} got no answer from rank 0 within "
                f"{timeout.total_seconds():.0f} s ({error})"
            ) from error
        instance = store.get(_answer_key(nonce)).decode()
        store.delete_key(_answer_key(nonce))
        store.set(_joined_key(instance, rank), b"")
    return dist.PrefixStore(f"chainermn/instance/{instance}", store), instance  # PrefixStore adds the "/"
