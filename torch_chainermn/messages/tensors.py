"""How the model-parallel functions' tensors travel point to point (torch_chainermn.functions and
links), and how their waits fail.

A transfer of CPU tensors is one message of bytes on the pair's tag: an int64 header, then every
tensor of the message packed, each at a 16-byte boundary. The receiver takes it whatever its size
(the backend's recv_message), and the header says what it is, so the receiver needs to know neither
shapes nor dtypes in advance; the tensors it gets lie in the message, without a copy:

    [MAGIC, kind, seq, count, spec_len, payload_bytes, device, tuple, spec...]   (padded to 16 bytes)
    spec: per tensor [dtype, requires_grad, ndim, *shape]

CUDA tensors travel as a payload of their own on the tag plus BODY_TAG_OFFSET, after a message that
holds the header only. A pipeline posts the receives of its messages ahead (receive_ahead).

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

import array
import itertools
import weakref

import torch
import torch.distributed as dist

from .._backend import backend_of
from .framing import wait_all

MAGIC = 0x4D4E4D50  # "MNMP"
KIND_ACTIVATION, KIND_GRADIENT, KIND_FAILURE = 1, 2, 3
KIND_NAMES = {KIND_ACTIVATION: "an activation", KIND_GRADIENT: "a gradient", KIND_FAILURE: "a failure report"}
# The payload of CUDA tensors travels on a tag of its own, after its header's message, so that
# messages can be received ahead of time (receive_ahead) without taking an earlier message's payload.
BODY_TAG_OFFSET = 1 << 20
_FIXED = 8  # header slots before the spec
_ALIGN = 16

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
DEVICES = ["cpu", "cuda"]

DELEGATE_HINT = (
    "A rank's backward reaches a send or a recv only through the graph: pass send's result as "
    "recv(..., delegate_variable=phi), join several sends with pseudo_connect(phi, ...), and return "
    "(or backprop from) the last delegate variable; torch_chainermn.MultiNodeChainList does this for you. "
    "A delegate variable that is dropped on one rank leaves its peer waiting here."
)


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
            meta.append((dtype, requires_grad, tuple(ints[i + 3 : i + 3 + ndim])))
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
            raise ValueError(
                f"{op}: {where} has dtype {t.dtype}, which cannot travel (use one of "
                f"{', '.join(str(d) for d in DTYPES)})"
            )
        if t.layout != torch.strided or t.device.type not in DEVICES:
            raise ValueError(f"{op}: {where} must be a dense CPU or CUDA tensor, got {t.layout} on {t.device}")
    if len({t.device.type for t in tensors}) > 1:
        raise ValueError(f"{op}: {name} on rank {rank} mixes devices ({', '.join(str(t.device) for t in tensors)})")


# ---- sequence numbers and the outbox, per group ------------------------------------------------------


class _PairState:
    def __init__(self):
        self.sent = itertools.count()  # activations sent to the peer on this tag
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
                _outbox.setdefault(key, []).extend(box[i + 1 :])
                raise


def _wait_all(works, what: str) -> None:
    """Wait; a failure of the backend (a timeout above all) names `what` and the usual cause."""
    wait_all(works, what, DELEGATE_HINT)


# ---- send and receive ----------------------------------------------------------------------------------


def _backend(group):
    """The group's ProcessGroupChainerMN (its recv_message), found once per group."""
    backend = _backends.get(group)
    if backend is None:
        backend = _backends[group] = backend_of(group, "recv")
    return backend


_backends: "weakref.WeakKeyDictionary[dist.ProcessGroup, object]" = weakref.WeakKeyDictionary()


def _header_bytes(slots: int) -> int:
    """Bytes a header of `slots` int64 takes at the front of a message (the payload starts aligned)."""
    return -(-8 * slots // _ALIGN) * _ALIGN


def _header(head: list[int]) -> tuple[torch.Tensor, int]:
    """`head` as the bytes at a message's front, padded with zeros to the payload's alignment, and
    where the payload starts."""
    start = _header_bytes(len(head))
    padded = head + [0] * (start // 8 - len(head))
    return torch.frombuffer(array.array("q", padded), dtype=torch.uint8), start


def _send_message(group, head: list[int], parts, spans, total: int, peer: int, tag: int):
    """Post one CPU message: `head`, then each part's bytes (contiguous CPU tensors of any dtype) at
    its span of the `total`-byte payload. The backend reads the parts before it returns (into the
    ring within a node, else into a buffer of its own), because the send is not waited for: the
    caller may change its tensors at once (autograd accumulates gradients in place)."""
    header, start = _header(head)
    offsets = [0] + [start + b for b, _ in spans]
    return _backend(group).send_message([header, *parts], offsets, start + total, peer, tag)


def _post_send(group, tensor: torch.Tensor, peer: int, tag: int):
    """Post a send of `tensor` to group rank `peer` straight on the group's backend (what dist.isend
    does, without its Python checks: these messages are ours, on a chainermn group)."""
    return _backend(group).send([tensor], peer, tag)


def send_tensors(group, peer: int, tag: int, kind: int, seq: int, tensors, is_tuple: bool, what: str) -> None:
    """Post `tensors` to `peer` (not waited for: see drain). CPU tensors go in the header's message;
    CUDA tensors follow it as a payload of their own on the body tag."""
    spec = Spec.of(tensors, is_tuple)
    spans, total = spec.offsets()
    ints = spec.ints()
    head = [MAGIC, kind, seq, len(spec.meta), len(ints), total, DEVICES.index(spec.device), int(is_tuple), *ints]
    if spec.device == "cpu":
        sent = [(t, span) for t, span in zip(tensors, spans) if span[1] > span[0]]
        works = [
            _send_message(group, head, [t.contiguous() for t, _ in sent], [span for _, span in sent], total, peer, tag)
        ]
    else:
        works = [_send_message(group, head, [], [], 0, peer, tag)]
        if total:
            payload = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
            for t, (b, e) in zip(tensors, spans):  # a copy: the send is not waited for (above)
                if e > b:
                    payload[b:e].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            works.append(_post_send(group, payload, peer, tag + BODY_TAG_OFFSET))
    _post(group, works, what)


def send_failure(group, peer: int, tag: int, error: BaseException, what: str) -> None:
    """Tell a peer waiting for a message that none comes, and why (it raises too)."""
    reason = f"{type(error).__name__}: {error}".encode()
    parts = [torch.frombuffer(bytearray(reason), dtype=torch.uint8)] if reason else []
    work = _send_message(
        group,
        [MAGIC, KIND_FAILURE, 0, 0, 0, len(reason), 0, 0],
        parts,
        [(0, len(reason))][: len(parts)],
        len(reason),
        peer,
        tag,
    )
    _post(group, [work], what)


_ahead: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict]" = weakref.WeakKeyDictionary()


class _Ahead:
    """The receives of one (peer, tag) pair's messages still to be posted ahead, and the one posted."""

    def __init__(self):
        self.expected = 0
        self.posted = None  # the Work of recv_message

    def post_next(self, group, peer: int, tag: int) -> None:
        # One at a time, so that a receive posted ahead never takes a message meant for a receive
        # that is not posted ahead (a recv of the same pair outside the pipeline's count).
        if self.posted is None and self.expected > 0:
            self.expected -= 1
            self.posted = _backend(group).recv_message(peer, tag)


def receive_ahead(group, peer: int, tag: int, count: int) -> None:
    """Expect `count` more messages from `peer` on `tag`: their receives are posted ahead, each as
    soon as the one before it has landed, so that a message arrives while this rank computes (a
    pipeline knows what it will receive). Only for messages that will surely come."""
    ahead = _ahead.setdefault(group, {}).setdefault((peer, tag), _Ahead())
    ahead.expected += count
    ahead.post_next(group, peer, tag)


def _recv_wait(group, tensor, peer: int, tag: int, what: str) -> None:
    _wait_all([dist.irecv(tensor, group=group, group_src=peer, tag=tag)], what)


def _tensor_at(message: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor over `message`'s bytes from `offset` (a multiple of 16): no copy, and a tensor of its
    own, not a view (autograd forbids in-place ops on views made in a custom Function's forward)."""
    return torch.empty(0, dtype=dtype).set_(message.untyped_storage(), offset // dtype.itemsize, shape)


def recv_tensors(
    group,
    peer: int,
    tag: int,
    expect_kind: int,
    expect_seq: int,
    what: str,
    waiting: str,
    device: torch.device | None = None,
):
    """Receive one message from `peer`: (tensors, spec). Raises if it is not what this rank expects.
    `what` names the receiving op in errors; `waiting` says, for a timeout, what never came and why."""
    ahead = _ahead.get(group, {}).get((peer, tag))
    if ahead is not None and ahead.posted is not None:
        work, ahead.posted = ahead.posted, None
        _wait_all([work], f"{what}: {waiting}")
        ahead.post_next(group, peer, tag)
    else:
        work = _backend(group).recv_message(peer, tag)
        _wait_all([work], f"{what}: {waiting}")
    message = work.get_future().value()[0]
    head = (
        message[: 8 * _FIXED].view(torch.int64).tolist()
        if message.dtype == torch.uint8 and message.numel() >= 8 * _FIXED
        else [0]
    )
    if head[0] != MAGIC:
        raise RuntimeError(
            f"{what}: received a message that is not a model-parallel message (another send on the same tag {tag}?)"
        )
    kind, seq, count, spec_len, payload, device_code, is_tuple = head[1:_FIXED]
    start = _header_bytes(_FIXED + spec_len)
    if kind == KIND_FAILURE:
        reason = message[start : start + payload].numpy().tobytes().decode(errors="replace")
        raise RuntimeError(f"{what}: rank {peer} could not send: {reason}")
    ints = message[8 * _FIXED : 8 * (_FIXED + spec_len)].view(torch.int64).tolist()
    spec = Spec.from_ints(ints, count, DEVICES[device_code], bool(is_tuple))
    spans, total = spec.offsets()
    if spec.device == "cpu":
        tensors = [
            _tensor_at(message, start + b, dtype, shape) if e > b else torch.empty(shape, dtype=dtype)
            for (dtype, _, shape), (b, e) in zip(spec.meta, spans)
        ]
    else:
        tensors = _recv_payload(group, peer, tag, spec, spans, total, device, what)
    if kind != expect_kind:
        raise RuntimeError(_wrong_kind(what, peer, tag, kind, seq, expect_kind))
    if seq != expect_seq:
        raise RuntimeError(
            f"{what}: got {KIND_NAMES[kind]} for message #{seq} of the pair where #{expect_seq} "
            f"was due: the ranks ran their sends/recvs (or their backward passes) in different "
            f"orders. {DELEGATE_HINT}"
        )
    if device is not None:
        tensors = [t.to(device) for t in tensors]
    return tensors, spec


def _recv_payload(group, peer: int, tag: int, spec: Spec, spans, total: int, device, what: str) -> list:
    """The CUDA tensors of a message, from the payload that follows its header on the body tag."""
    wire = device if device is not None and torch.device(device).type == "cuda" else torch.device("cuda")
    # One tensor lands in a tensor of its own; several land in one buffer and are copied out, so that
    # every received tensor is a tensor of its own (not a view).
    single = torch.empty(spec.meta[0][2], dtype=spec.meta[0][0], device=wire) if len(spec.meta) == 1 else None
    buffer = (
        single.reshape(-1).view(torch.uint8)
        if single is not None
        else torch.empty(total, dtype=torch.uint8, device=wire)
    )
    if total:
        _recv_wait(
            group, buffer, peer, tag + BODY_TAG_OFFSET, f"{what}: the data from rank {peer} never came after its header"
        )
    if single is not None:
        return [single]
    return [
        buffer[b:e].view(dtype).reshape(shape).clone() if e > b else torch.empty(shape, dtype=dtype, device=wire)
        for (dtype, _, shape), (b, e) in zip(spec.meta, spans)
    ]


def _wrong_kind(what: str, peer: int, tag: int, kind: int, seq: int, expect_kind: int) -> str:
    if kind == KIND_GRADIENT and expect_kind == KIND_ACTIVATION:
        return (
            f"{what}: got a gradient where an activation was due: it is the gradient of this rank's "
            f"send #{seq} to rank {peer} (tag {tag}), which this rank's backward never collected, so "
            f"that send's delegate variable never reached backward here. {DELEGATE_HINT}"
        )
    return (
        f"{what}: got {KIND_NAMES.get(kind, f'kind {kind}')} (message #{seq}) where "
        f"{KIND_NAMES[expect_kind]} was due. {DELEGATE_HINT}"
    )
