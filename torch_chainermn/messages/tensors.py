"""How the model-parallel functions' tensors travel point to point (torch_chainermn.functions and
links), and how their waits fail.

A transfer is two messages: a fixed-size int64 header on the pair's tag, then one payload of bytes
(every tensor of the message packed, each at a 16-byte boundary; skipped when empty) on the tag
plus BODY_TAG_OFFSET, so that a pipeline can post the receives of headers ahead (receive_ahead). The header
says what the message is, so the receiver needs to know neither shapes nor dtypes in advance:

    [MAGIC, kind, seq, count, spec_len, payload_bytes, device, tuple, spec...]
    spec: per tensor [dtype, requires_grad, ndim, *shape]   (sent as a third message if it is long)

`kind` tells an activation (forward) from a gradient (backward) and from a failure report. Both
directions use the caller's tag, so a gradient that a rank's backward never collected (its
delegate variable was dropped) reaches that rank's next recv on the pair, whose header check then
names the mistake instead of reading a gradient as an activation. `seq` numbers the activations of
a (group, peer, tag) pair; a gradient carries the seq of the activation it belongs to, so ranks
that run their backward passes in different orders get an error, not each other's gradients.

Sends are posted with isend and not waited for (an outbox keeps their Works), so a stage can go on
computing while its activations travel; `drain` waits for them. Every wait the backend fails (a
timeout above all: DistBackendError) is re-raised naming the send or recv that was never joined,
and the usual cause: a delegate variable that never reached backward.
"""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from .framing import wait_all

MAGIC = 0x4D4E4D50  # "MNMP"
KIND_ACTIVATION, KIND_GRADIENT, KIND_FAILURE = 1, 2, 3
KIND_NAMES = {KIND_ACTIVATION: "an activation", KIND_GRADIENT: "a gradient", KIND_FAILURE: "a failure report"}
HEADER_LEN = 32
# A message's body (payload, long spec, failure reason) travels on a tag of its own, so that headers
# can be received ahead of time (receive_ahead) without taking an earlier message's body.
BODY_TAG_OFFSET = 1 << 20
_FIXED = 8  # header slots before the inline spec
_ALIGN = 16

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
DEVICES = ["cpu", "cuda"]

DELEGATE_HINT = (
    "A rank's backward reaches a send or a recv only through the graph: pass send's result as "
    "recv(..., delegate_variable=phi), join several sends with pseudo_connect(phi, ...), and return "
    "(or backprop from) the last delegate variable; torch_chainermn.MultiNodeChainList does this for you. "
    "A delegate variable that is dropped on one rank leaves its peer waiting here.")


class Spec:
    """What a message carries: per tensor (dtype, requires_grad, shape), the device kind it travels
    on, and whether the sender passed a tuple."""

    def __init__(self, tensors_meta, device: str, is_tuple: bool):
        self.meta = tensors_meta  # [(dtype, requires_grad, shape)]
        self.device = device
        self.is_tuple = is_tuple

    @classmethod
    def of(cls, tensors, is_tuple: bool) -> "Spec":
        device = tensors[0].device.type if tensors else "cpu"
        return cls([(t.dtype, bool(t.requires_grad), tuple(t.shape)) for t in tensors], device, is_tuple)

    def ints(self) -> list[int]:
        out = []
        for dtype, requires_grad, shape in self.meta:
            out += [_DTYPE_CODE[dtype], int(requires_grad), len(shape), *shape]
        return out

    @classmethod
    def from_ints(cls, ints, count: int, device: str, is_tuple: bool) -> "Spec":
        meta, i = [], 0
        for _ in range(count):
            dtype, requires_grad, ndim = DTYPES[ints[i]], bool(ints[i + 1]), ints[i + 2]
            meta.append((dtype, requires_grad, tuple(ints[i + 3:i + 3 + ndim])))
            i += 3 + ndim
        return cls(meta, device, is_tuple)

    def offsets(self) -> tuple[list[tuple[int, int]], int]:
        """Where each tensor's bytes lie in the payload, and the payload's size."""
        spans, at = [], 0
        for dtype, _, shape in self.meta:
            nbytes = _numel(shape) * dtype.itemsize
            spans.append((at, at + nbytes))
            at += -(-nbytes // _ALIGN) * _ALIGN
        return spans, (spans[-1][1] if spans else 0)

    def describe(self) -> str:
        return ", ".join(f"{str(dtype).replace('torch.', '')}{list(shape)}" for dtype, _, shape in self.meta)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_sendable(op: str, name: str, tensors, rank: int) -> None:
    for i, t in enumerate(tensors):
        where = f"{name} on rank {rank}" if len(tensors) == 1 else f"{name}[{i}] on rank {rank}"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {where} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_CODE:
            raise ValueError(f"{op}: {where} has dtype {t.dtype}, which cannot travel (use one of "
                             f"{', '.join(str(d) for d in DTYPES)})")
        if t.layout != torch.strided or t.device.type not in DEVICES:
            raise ValueError(f"{op}: {where} must be a dense CPU or CUDA tensor, got {t.layout} on {t.device}")
    if len({t.device.type for t in tensors}) > 1:
        raise ValueError(f"{op}: {name} on rank {rank} mixes devices ({', '.join(str(t.device) for t in tensors)})")


# ---- sequence numbers and the outbox, per group ------------------------------------------------------

class _PairState:
    def __init__(self):
        self.sent = itertools.count()      # activations sent to the peer on this tag
        self.received = itertools.count()  # activations received from the peer on this tag


# Per group (weakly: a destroyed group's numbers go with it, and a new group starts from zero).
_pairs: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict]" = weakref.WeakKeyDictionary()
_outbox: "weakref.WeakKeyDictionary[dist.ProcessGroup, list]" = weakref.WeakKeyDictionary()  # [(works, what)]


def pair(group, peer: int, tag: int) -> _PairState:
    return _pairs.setdefault(group, {}).setdefault((peer, tag), _PairState())


def _post(group, works, what: str) -> None:
    box = _outbox.setdefault(group, [])
    box.append((works, what))
    if len(box) > 64:  # keep the list short: forget what has already gone (and raise what failed)
        still = []
        for entry in box:
            if all(w.is_completed() for w in entry[0]):
                _wait_all(entry[0], entry[1])
            else:
                still.append(entry)
        box[:] = still


def drain(comm=None) -> None:
    """Wait until every send this process posted on `comm` (a communicator or ProcessGroup; None: on
    every group) has gone: a send returns as soon as it is posted, and its errors surface here."""
    group = getattr(comm, "group", comm)
    keys = list(_outbox) if group is None else [group]
    for key in keys:
        box = _outbox.pop(key, [])
        for i, (works, what) in enumerate(box):
            try:
                _wait_all(works, what)
            except BaseException:
                _outbox.setdefault(key, []).extend(box[i + 1:])
                raise


def _wait_all(works, what: str) -> None:
    """Wait; a failure of the backend (a timeout above all) names `what` and the usual cause."""
    wait_all(works, what, DELEGATE_HINT)


# ---- send and receive ----------------------------------------------------------------------------------

def _header(kind: int, seq: int, spec: Spec | None, payload: int, extra: list[int] | None = None) -> torch.Tensor:
    ints = spec.ints() if spec is not None else (extra or [])
    count = len(spec.meta) if spec is not None else 0
    device = DEVICES.index(spec.device) if spec is not None else 0
    is_tuple = int(spec.is_tuple) if spec is not None else 0
    head = [MAGIC, kind, seq, count, len(ints), payload, device, is_tuple]
    if len(head) + len(ints) <= HEADER_LEN:
        head += ints
    head += [0] * (HEADER_LEN - len(head))
    return torch.tensor(head, dtype=torch.int64)


def _pack(tensors, spec: Spec) -> torch.Tensor:
    """A copy of the tensors' bytes, back to back at aligned offsets. A copy, because the send is not
    waited for: the caller may change its tensors at once (autograd accumulates gradients in place)."""
    spans, total = spec.offsets()
    payload = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for t, (b, e) in zip(tensors, spans):
        if e > b:
            payload[b:e].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return payload


def send_tensors(group, peer: int, tag: int, kind: int, seq: int, tensors, is_tuple: bool, what: str) -> None:
    """Post the header and payload of `tensors` to `peer` (not waited for: see drain)."""
    spec = Spec.of(tensors, is_tuple)
    spans, total = spec.offsets()
    header = _header(kind, seq, spec, total)
    works = [dist.isend(header, group=group, group_dst=peer, tag=tag)]
    ints = spec.ints()
    body = tag + BODY_TAG_OFFSET
    if _FIXED + len(ints) > HEADER_LEN:
        works.append(dist.isend(torch.tensor(ints, dtype=torch.int64), group=group, group_dst=peer, tag=body))
    if total:
        works.append(dist.isend(_pack(tensors, spec), group=group, group_dst=peer, tag=body))
    _post(group, works, what)


def send_failure(group, peer: int, tag: int, error: BaseException, what: str) -> None:
    """Tell a peer waiting for a message that none comes, and why (it raises too)."""
    reason = f"{type(error).__name__}: {error}".encode()
    works = [dist.isend(_header(KIND_FAILURE, 0, None, len(reason)), group=group, group_dst=peer, tag=tag)]
    if reason:
        works.append(dist.isend(torch.frombuffer(bytearray(reason), dtype=torch.uint8), group=group,
                                group_dst=peer, tag=tag + BODY_TAG_OFFSET))
    _post(group, works, what)


_ahead: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict]" = weakref.WeakKeyDictionary()


class _Ahead:
    """The header receives of one (peer, tag) pair still to be posted ahead, and the one posted."""

    def __init__(self):
        self.expected = 0
        self.posted = None  # (header, work)

    def post_next(self, group, peer: int, tag: int) -> None:
        # One at a time: with several receives pending on one peer and tag, the backend may pair
        # a later receive with an earlier message (it posts each data receive when its header lands).
        if self.posted is None and self.expected > 0:
            self.expected -= 1
            header = torch.empty(HEADER_LEN, dtype=torch.int64)
            self.posted = (header, dist.irecv(header, group=group, group_src=peer, tag=tag))


def receive_ahead(group, peer: int, tag: int, count: int) -> None:
    """Expect `count` more messages from `peer` on `tag`: their header receives are posted ahead, each
    as soon as the one before it has landed, so that a header arrives while this rank computes
    (a pipeline knows what it will receive). Only for messages that will surely come."""
    ahead = _ahead.setdefault(group, {}).setdefault((peer, tag), _Ahead())
    ahead.expected += count
    ahead.post_next(group, peer, tag)


def _recv_wait(group, tensor, peer: int, tag: int, what: str) -> None:
    _wait_all([dist.irecv(tensor, group=group, group_src=peer, tag=tag)], what)


def recv_tensors(group, peer: int, tag: int, expect_kind: int, expect_seq: int, what: str, waiting: str,
                 device: torch.device | None = None):
    """Receive one message from `peer`: (tensors, spec). Raises if it is not what this rank expects.
    `what` names the receiving op in errors; `waiting` says, for a timeout, what never came and why."""
    ahead = _ahead.get(group, {}).get((peer, tag))
    if ahead is not None and ahead.posted is not None:
        (header, work), ahead.posted = ahead.posted, None
        _wait_all([work], f"{what}: {waiting}")
        ahead.post_next(group, peer, tag)
    else:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        _recv_wait(group, header, peer, tag, f"{what}: {waiting}")
    head = header.tolist()
    body = tag + BODY_TAG_OFFSET  # the rest of the message
    if head[0] != MAGIC:
        raise RuntimeError(f"{what}: received a message that is not a model-parallel message (another "
                           f"send on the same tag {tag}?)")
    kind, seq, count, spec_len, payload, device_code, is_tuple = head[1:_FIXED]
    if kind == KIND_FAILURE:
        reason = torch.empty(payload, dtype=torch.uint8)
        if payload:
            _recv_wait(group, reason, peer, body, f"{what}: the failure report from rank {peer} was cut short")
        raise RuntimeError(f"{what}: rank {peer} could not send: {bytes(reason.tolist()).decode(errors='replace')}")
    if _FIXED + spec_len <= HEADER_LEN:
        ints = head[_FIXED:_FIXED + spec_len]
    else:
        long_spec = torch.empty(spec_len, dtype=torch.int64)
        _recv_wait(group, long_spec, peer, body, f"{what}: the header from rank {peer} was cut short")
        ints = long_spec.tolist()
    spec = Spec.from_ints(ints, count, DEVICES[device_code], bool(is_tuple))
    wire = torch.device(spec.device) if spec.device == "cpu" else (
        device if device is not None and torch.device(device).type == "cuda" else torch.device("cuda"))
    spans, total = spec.offsets()
    # One tensor lands in a tensor of its own; several land in one buffer and are copied out, so that
    # every received tensor is a tensor of its own (not a view: autograd forbids in-place ops on views
    # made in a custom Function's forward).
    single = torch.empty(spec.meta[0][2], dtype=spec.meta[0][0], device=wire) if len(spec.meta) == 1 else None
    buffer = single.reshape(-1).view(torch.uint8) if single is not None else \
        torch.empty(total, dtype=torch.uint8, device=wire)
    if total:
        _recv_wait(group, buffer, peer, body, f"{what}: the data from rank {peer} never came after its header")
    if kind != expect_kind:
        raise RuntimeError(_wrong_kind(what, peer, tag, kind, seq, expect_kind))
    if seq != expect_seq:
        raise RuntimeError(f"{what}: got {KIND_NAMES[kind]} for message #{seq} of the pair where #{expect_seq} "
                           f"was due: the ranks ran their sends/recvs (or their backward passes) in different "
                           f"orders. {DELEGATE_HINT}")
    if single is not None:
        tensors = [single]
    else:
        tensors = [buffer[b:e].view(dtype).reshape(shape).clone() if e > b else
                   torch.empty(shape, dtype=dtype, device=wire) for (dtype, _, shape), (b, e) in zip(spec.meta, spans)]
    if device is not None:
        tensors = [t.to(device) for t in tensors]
    return tensors, spec


def _wrong_kind(what: str, peer: int, tag: int, kind: int, seq: int, expect_kind: int) -> str:
    if kind == KIND_GRADIENT and expect_kind == KIND_ACTIVATION:
        return (f"{what}: got a gradient where an activation was due: it is the gradient of this rank's "
                f"send #{seq} to rank {peer} (tag {tag}), which this rank's backward never collected, so "
                f"that send's delegate variable never reached backward here. {DELEGATE_HINT}")
    return (f"{what}: got {KIND_NAMES.get(kind, f'kind {kind}')} (message #{seq}) where "
            f"{KIND_NAMES[expect_kind]} was due. {DELEGATE_HINT}")

