"""Any picklable object between ranks: the communicator's _obj methods and send/recv/bcast of arrays,
scatter_dataset, the iterators, and agree().

Objects are pickled, except that dense tensors and numeric arrays inside them are lifted out of the
pickle and sent as raw bytes (exact, no copy through pickle's byte string). A message is a header,
`[status, nbytes, chunk]`, then the bytes in chunks of at most `chunk`. A rank that cannot take part
(bad argument on the root, an object that does not pickle) still sends a header, with a failure
status and the reason, so the other ranks raise too instead of waiting for data that never comes.
"""

from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist

from .arrays import allocate, bytes_of, finish, is_raw_array, spec_of
from .framing import DEFAULT_MAX_BUF_LEN, bcast_bytes, bytes_view, recv_bytes, send_bytes

_OK, _REFUSED, _FAILED = 0, 1, 2  # header status: refused = bad argument (ValueError); failed = anything else


class _Pickler(pickle.Pickler):
    """Pickles an object with its arrays left out; they are listed in `arrays`, to be sent raw."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = []

    def persistent_id(self, obj):
        if not is_raw_array(obj):
            return None
        self.arrays.append(obj)
        return len(self.arrays) - 1, spec_of(obj)


class _Unpickler(pickle.Unpickler):
    """Rebuilds the object with empty arrays in place of the raw ones; `landing` lists where they go."""

    def __init__(self, file):
        super().__init__(file)
        self.landing = []  # (array, flat uint8 view, spec), in the order the sender listed them

    def persistent_load(self, pid):
        _, spec = pid
        array, flat = allocate(spec)
        self.landing.append((array, flat, spec))
        return array


def _encode(obj) -> tuple[bytes, list[torch.Tensor]]:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), [bytes_of(array) for array in pickler.arrays]


def _decode(skeleton: torch.Tensor):
    unpickler = _Unpickler(io.BytesIO(skeleton.numpy().tobytes()))
    return unpickler.load(), unpickler.landing


def _header(status: int, nbytes: int, chunk: int) -> torch.Tensor:
    return torch.tensor([status, nbytes, chunk], dtype=torch.int64)


def _raise_remote(op: str, status: int, peer: int, reason: torch.Tensor):
    kind = ValueError if status == _REFUSED else RuntimeError
    raise kind(f"{op}: rank {peer} could not take part: {reason.numpy().tobytes().decode(errors='replace')}")


def _reason(error: BaseException) -> bytes:
    return f"{type(error).__name__}: {error}".encode()


def _status_of(error: BaseException) -> int:
    return _REFUSED if isinstance(error, ValueError) else _FAILED


def send_object(group, obj, peer: int, tag: int, chunk: int, op: str) -> None:
    """Send any picklable object (arrays inside travel raw). A failure to pickle is reported to the
    receiver before it is raised here."""
    try:
        skeleton, arrays = _encode(obj)
    except Exception as error:
        send_failure(group, peer, tag, op, error)
        raise
    dist.send(_header(_OK, len(skeleton), chunk), group=group, group_dst=peer, tag=tag)
    send_bytes(group, bytes_view(skeleton), peer, tag, chunk)
    for flat in arrays:
        send_bytes(group, flat, peer, tag, chunk)


def send_failure(group, peer: int, tag: int, op: str, error: BaseException) -> None:
    """Tell a receiver waiting in recv_object that nothing comes, and why."""
    reason = _reason(error)
    dist.send(_header(_status_of(error), len(reason), DEFAULT_MAX_BUF_LEN), group=group, group_dst=peer, tag=tag)
    send_bytes(group, bytes_view(reason), peer, tag, DEFAULT_MAX_BUF_LEN)


def recv_object(group, peer: int, tag: int, op: str):
    """Receive what send_object (or send_failure) sent; a failure raises here too."""
    header = torch.empty(3, dtype=torch.int64)
    dist.recv(header, group=group, group_src=peer, tag=tag)
    status, nbytes, chunk = header.tolist()
    skeleton = torch.empty(nbytes, dtype=torch.uint8)
    recv_bytes(group, skeleton, peer, tag, chunk)
    if status != _OK:
        _raise_remote(op, status, peer, skeleton)
    obj, landing = _decode(skeleton)
    for _, flat, _ in landing:
        recv_bytes(group, flat, peer, tag, chunk)
    for array, _, spec in landing:
        finish(array, spec)
    return obj


def bcast_object(group, obj, root: int, chunk: int, op: str, refusal: BaseException | None = None):
    """Broadcast any picklable object from `root` (arrays inside travel raw). On the root, `refusal`
    (or a failure to pickle) is broadcast instead, and every rank raises."""
    if dist.get_rank(group) == root:
        failure, arrays = refusal, []
        if failure is None:
            try:
                skeleton, arrays = _encode(obj)
            except Exception as error:  # noqa: BLE001  reported to every rank, then raised
                failure = error
        status = _OK if failure is None else _status_of(failure)
        payload = skeleton if failure is None else _reason(failure)
        dist.broadcast(_header(status, len(payload), chunk), group=group, group_src=root)
        bcast_bytes(group, bytes_view(payload), root, chunk)
        if failure is not None:
            raise failure
        for flat in arrays:
            bcast_bytes(group, flat, root, chunk)
        return obj  # as in ChainerMN, the root gets back what it sent
    header = torch.empty(3, dtype=torch.int64)
    dist.broadcast(header, group=group, group_src=root)
    status, nbytes, chunk = header.tolist()
    payload = torch.empty(nbytes, dtype=torch.uint8)
    bcast_bytes(group, payload, root, chunk)
    if status != _OK:
        _raise_remote(op, status, root, payload)
    received, landing = _decode(payload)
    for _, flat, _ in landing:
        bcast_bytes(group, flat, root, chunk)
    for array, _, spec in landing:
        finish(array, spec)
    return received


def allgather_small(group, obj) -> list:
    """Every rank's (small, picklable) object, on every rank: for metadata, not for data."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    size = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.empty(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)
    width = max(int(n.item()) for n in lengths)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: len(payload)] = bytes_view(payload)
    gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, lengths)]


class _Refusal:
    """What a rank contributes to an agreement when its own arguments are wrong."""

    def __init__(self, reason: str):
        self.reason = reason


def agree(group, describe) -> list:
    """All ranks' `describe()`, on every rank; if any rank's raised ValueError, every rank raises it."""
    try:
        mine = describe()
    except ValueError as error:
        mine = _Refusal(str(error))
    everyone = allgather_small(group, mine)
    refusals = [
        f"{entry.reason} (on rank {rank})" for rank, entry in enumerate(everyone) if isinstance(entry, _Refusal)
    ]
    if refusals:
        raise ValueError("; ".join(refusals))
    return everyone


def agree_on_settings(group, op: str, describe) -> dict:
    """This rank's `describe()`, a dict of settings, once every rank of `group` holds the same: else
    the same ValueError on every rank, naming `op`, the first setting that differs and each rank's
    value of it ("ranks 0,2 have threshold=0.5; rank 1 has threshold=0.25", as the backend names a
    collective's differing setting). A ValueError from any rank's describe() raises on every rank
    (agree()). Once per configuration, not per step: one small all-gather."""
    everyone = agree(group, describe)
    names = list(dict.fromkeys(name for settings in everyone for name in settings))
    for name in names:
        values = [settings.get(name) for settings in everyone]
        if any(value != values[0] for value in values):
            held: dict[str, list[int]] = {}  # each value's repr -> the ranks that hold it, in order of first rank
            for rank, value in enumerate(values):
                held.setdefault(f"{name}={value!r}", []).append(rank)
            by_value = "; ".join(
                f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))} "
                f"{'have' if len(ranks) > 1 else 'has'} {value}"
                for value, ranks in held.items()
            )
            raise ValueError(f"{op}: the ranks differ in {name}: {by_value}")
    return everyone[dist.get_rank(group)]
