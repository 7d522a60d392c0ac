"""ChainerMN's communicator object, on a chainermn process group.

    comm = torch_chainermn.create_communicator("hierarchical", allreduce_grad_dtype=torch.float16)
    comm.bcast_data(model)                 # everyone starts from rank 0's parameters
    ...
    loss.backward()
    comm.multi_node_mean_grad(model)       # ChainerMN's allreduce_grad: one packed mean of all gradients

The methods are ChainerMN's (`chainermn.CommunicatorBase`): `send/recv/bcast/gather/allgather/scatter/
alltoall/allreduce` move torch tensors or numpy arrays (and give back the kind they were given, with the
exact dtype and shape), the `_obj` variants move any picklable object. Ranks and sizes are those of the
communicator's own group. Every method is collective over the communicator unless it is point to point,
and every rank must call them in the same order.

How things travel. Objects are pickled, except that dense tensors and numeric arrays inside them are
lifted out of the pickle and sent as raw bytes (exact, no copy through pickle's byte string). A
message is a header, `[status, nbytes, chunk]`, then the bytes in chunks of at most `max_buf_len`
(MPI counts are C ints, so anything over 2 GiB must be chunked). A rank that cannot take part (bad
argument on the root, an object that does not pickle) still sends a header, with a failure status
and the reason, so the other ranks raise too instead of waiting for data that never comes.
"""
from __future__ import annotations

import functools
import io
import operator
import os
import pickle
import warnings

import numpy as np
import torch
import torch.distributed as dist

from ._backend import backend_of
from .gradients import mean_coalesced
from .options import Options
from .topology import topology

__all__ = ["Communicator", "create_communicator"]

DEFAULT_MAX_BUF_LEN = 256 * 1024 * 1024  # ChainerMN's default chunk for pickled objects
MAX_BUF_LEN_LIMIT = 2**31 - 1  # one MPI message counts at most INT_MAX elements

# Tags from RESERVED_TAG up are used by the toolkit's own point-to-point traffic (gather_obj,
# scatter_dataset); MPI only promises tags up to 32767, so user tags stay below.
RESERVED_TAG = 32000
TAG_GATHER_OBJ = RESERVED_TAG + 1
TAG_SCATTER_DATASET = RESERVED_TAG + 2

_OK, _REFUSED, _FAILED = 0, 1, 2  # header status: refused = bad argument (ValueError); failed = anything else


# ---- argument checks ------------------------------------------------------------------------------

def check_rank(op: str, name: str, value, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < size:
        raise ValueError(f"{op}: {name} must be a rank in [0, {size}), got {value!r}")
    return int(value)


def _check_tag(op: str, tag) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < RESERVED_TAG:
        raise ValueError(f"{op}: tag must be an int in [0, {RESERVED_TAG}), got {tag!r}")
    return int(tag)


def check_max_buf_len(op: str, value) -> int:
    """max_buf_len as a chunk size in bytes: None means DEFAULT_MAX_BUF_LEN."""
    if value is None:
        return DEFAULT_MAX_BUF_LEN
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 < value <= MAX_BUF_LEN_LIMIT:
        raise ValueError(f"{op}: max_buf_len must be an int in [1, {MAX_BUF_LEN_LIMIT}], got {value!r}")
    return int(value)


# ---- arrays as raw bytes --------------------------------------------------------------------------
# A spec says how to rebuild an array from its bytes:
#   ("torch", dtype, shape, device_type, requires_grad) or ("numpy", dtype, shape).

def _is_raw_array(obj) -> bool:
    """Arrays that travel as raw bytes: plain dense tensors and numpy arrays without Python objects."""
    if type(obj) is torch.Tensor:
        return obj.layout == torch.strided and not obj.is_quantized and not obj.is_nested and not obj.is_meta
    return type(obj) is np.ndarray and not obj.dtype.hasobject


def _spec_of(array) -> tuple:
    if isinstance(array, torch.Tensor):
        return ("torch", array.dtype, tuple(array.shape), array.device.type, array.requires_grad)
    return ("numpy", array.dtype, array.shape)


def _nbytes(spec) -> int:
    count = int(np.prod(spec[2], dtype=np.int64))
    itemsize = spec[1].itemsize
    return count * itemsize


def _bytes_of(array) -> torch.Tensor:
    """The array's bytes as a flat uint8 tensor, without a copy where it is already contiguous."""
    if isinstance(array, torch.Tensor):
        flat = array.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        return flat.view(torch.uint8)
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays: we only send from them
        return torch.from_numpy(flat)


def _allocate(spec, device_type: str | None = None):
    """An empty array for `spec` and a flat uint8 tensor over its memory, to receive into."""
    if spec[0] == "torch":
        _, dtype, shape, own_device_type, _ = spec
        tensor = torch.empty(shape, dtype=dtype, device=torch.device(device_type or own_device_type))
        return tensor, tensor.reshape(-1).view(torch.uint8)
    _, dtype, shape = spec
    array = np.empty(shape, dtype=dtype)
    return array, torch.from_numpy(array.reshape(-1).view(np.uint8))


def _finish(array, spec):
    if spec[0] == "torch" and spec[4]:
        array.requires_grad_(True)
    return array


def _bytes_view(data: bytes) -> torch.Tensor:
    """A uint8 tensor over `data` without a copy (it is only sent from, never written)."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class _Pickler(pickle.Pickler):
    """Pickles an object with its arrays left out; they are listed in `arrays`, to be sent raw."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = []

    def persistent_id(self, obj):
        if not _is_raw_array(obj):
            return None
        self.arrays.append(obj)
        return len(self.arrays) - 1, _spec_of(obj)


class _Unpickler(pickle.Unpickler):
    """Rebuilds the object with empty arrays in place of the raw ones; `landing` lists where they go."""

    def __init__(self, file):
        super().__init__(file)
        self.landing = []  # (array, flat uint8 view, spec), in the order the sender listed them

    def persistent_load(self, pid):
        _, spec = pid
        array, flat = _allocate(spec)
        self.landing.append((array, flat, spec))
        return array


def _encode(obj) -> tuple[bytes, list[torch.Tensor]]:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), [_bytes_of(array) for array in pickler.arrays]


def _decode(skeleton: torch.Tensor):
    unpickler = _Unpickler(io.BytesIO(skeleton.numpy().tobytes()))
    return unpickler.load(), unpickler.landing


# ---- framed, chunked byte transfer ----------------------------------------------------------------

def _chunks(nbytes: int, chunk: int):
    return [(start, min(start + chunk, nbytes)) for start in range(0, nbytes, chunk)]


def _wait_all(works) -> None:
    for work in works:
        work.wait()


def _send_raw(group, flat: torch.Tensor, peer: int, tag: int, chunk: int) -> None:
    _wait_all([dist.isend(flat[b:e], group=group, group_dst=peer, tag=tag) for b, e in _chunks(flat.numel(), chunk)])


def _recv_raw(group, flat: torch.Tensor, peer: int, tag: int, chunk: int) -> None:
    _wait_all([dist.irecv(flat[b:e], group=group, group_src=peer, tag=tag) for b, e in _chunks(flat.numel(), chunk)])


def _bcast_raw(group, flat: torch.Tensor, root: int, chunk: int) -> None:
    _wait_all([dist.broadcast(flat[b:e], group=group, group_src=root, async_op=True)
               for b, e in _chunks(flat.numel(), chunk)])


def _header(status: int, nbytes: int, chunk: int) -> torch.Tensor:
    return torch.tensor([status, nbytes, chunk], dtype=torch.int64)


def _raise_remote(op: str, status: int, peer: int, reason: torch.Tensor):
    kind = ValueError if status == _REFUSED else RuntimeError
    raise kind(f"{op}: rank {peer} could not take part: {reason.numpy().tobytes().decode(errors='replace')}")


def _reason(error: BaseException) -> bytes:
    return f"{type(error).__name__}: {error}".encode()


def _status_of(error: BaseException) -> int:
    return _REFUSED if isinstance(error, ValueError) else _FAILED


def send_structured(group, obj, peer: int, tag: int, chunk: int, op: str) -> None:
    """Send any picklable object (arrays inside travel raw). A failure to pickle is reported to the
    receiver before it is raised here."""
    try:
        skeleton, arrays = _encode(obj)
    except Exception as error:
        send_failure(group, peer, tag, op, error)
        raise
    dist.send(_header(_OK, len(skeleton), chunk), group=group, group_dst=peer, tag=tag)
    _send_raw(group, _bytes_view(skeleton), peer, tag, chunk)
    for flat in arrays:
        _send_raw(group, flat, peer, tag, chunk)


def send_failure(group, peer: int, tag: int, op: str, error: BaseException) -> None:
    """Tell a receiver waiting in recv_structured that nothing comes, and why."""
    reason = _reason(error)
    dist.send(_header(_status_of(error), len(reason), DEFAULT_MAX_BUF_LEN), group=group, group_dst=peer, tag=tag)
    _send_raw(group, _bytes_view(reason), peer, tag, DEFAULT_MAX_BUF_LEN)


def recv_structured(group, peer: int, tag: int, op: str):
    """Receive what send_structured (or send_failure) sent; a failure raises here too."""
    header = torch.empty(3, dtype=torch.int64)
    dist.recv(header, group=group, group_src=peer, tag=tag)
    status, nbytes, chunk = header.tolist()
    skeleton = torch.empty(nbytes, dtype=torch.uint8)
    _recv_raw(group, skeleton, peer, tag, chunk)
    if status != _OK:
        _raise_remote(op, status, peer, skeleton)
    obj, landing = _decode(skeleton)
    for _, flat, _ in landing:
        _recv_raw(group, flat, peer, tag, chunk)
    for array, _, spec in landing:
        _finish(array, spec)
    return obj


def bcast_structured(group, obj, root: int, chunk: int, op: str, refusal: BaseException | None = None):
    """Broadcast any picklable object from `root` (arrays inside travel raw). On the root, `refusal`
    (or a failure to pickle) is broadcast instead, and every rank raises."""
    is_root = dist.get_rank(group) == root
    if is_root:
        failure, arrays = refusal, []
        if failure is None:
            try:
                skeleton, arrays = _encode(obj)
            except Exception as error:  # noqa: BLE001  reported to every rank, then raised
                failure = error
        status = _OK if failure is None else _status_of(failure)
        payload = skeleton if failure is None else _reason(failure)
        header = _header(status, len(payload), chunk)
        dist.broadcast(header, group=group, group_src=root)
        _bcast_raw(group, _bytes_view(payload), root, chunk)
        if failure is not None:
            raise failure
        for flat in arrays:
            _bcast_raw(group, flat, root, chunk)
        return obj  # as in ChainerMN, the root gets back what it sent
    header = torch.empty(3, dtype=torch.int64)
    dist.broadcast(header, group=group, group_src=root)
    status, nbytes, chunk = header.tolist()
    payload = torch.empty(nbytes, dtype=torch.uint8)
    _bcast_raw(group, payload, root, chunk)
    if status != _OK:
        _raise_remote(op, status, root, payload)
    received, landing = _decode(payload)
    for _, flat, _ in landing:
        _bcast_raw(group, flat, root, chunk)
    for array, _, spec in landing:
        _finish(array, spec)
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
    padded[:len(payload)] = _bytes_view(payload)
    gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(g[:int(n.item())].numpy().tobytes()) for g, n in zip(gathered, lengths)]


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
    refusals = [f"{entry.reason} (on rank {rank})" for rank, entry in enumerate(everyone)
                if isinstance(entry, _Refusal)]
    if refusals:
        raise ValueError("; ".join(refusals))
    return everyone


# ---- padded, chunked collectives on bytes ---------------------------------------------------------

def _padded(flat: torch.Tensor, width: int) -> torch.Tensor:
    """`flat` widened to `width` bytes (collectives move equal sizes from every rank)."""
    if flat.numel() == width:
        return flat
    out = torch.zeros(width, dtype=torch.uint8, device=flat.device)
    out[:flat.numel()] = flat
    return out


def _landing(flat: torch.Tensor, width: int) -> torch.Tensor:
    """Where `width` bytes land before the first flat.numel() of them go to `flat`."""
    return flat if flat.numel() == width else torch.empty(width, dtype=torch.uint8, device=flat.device)


def _land(flat: torch.Tensor, landed: torch.Tensor) -> None:
    if landed is not flat:
        flat.copy_(landed[:flat.numel()])


# ---- data arguments -------------------------------------------------------------------------------

def _as_array(op: str, name: str, data):
    """`data` as a torch tensor or numpy array (numpy scalars become 0-d arrays), or ValueError."""
    if isinstance(data, np.generic):
        data = np.asarray(data)
    if isinstance(data, (torch.Tensor, np.ndarray)):
        if isinstance(data, torch.Tensor) and data.layout != torch.strided:
            raise ValueError(f"{op}: {name} must be a dense (strided) tensor, got layout {data.layout}")
        if isinstance(data, np.ndarray) and data.dtype.hasobject:
            raise ValueError(f"{op}: {name} must be a numeric numpy array, got dtype object (use the _obj variant)")
        return data
    raise ValueError(f"{op}: {name} must be a torch.Tensor or numpy.ndarray, got {type(data).__name__}")


def _as_plain(array):
    """Tensors that are subclasses (e.g. Parameter) travel as plain tensors of the same data."""
    if isinstance(array, torch.Tensor) and type(array) is not torch.Tensor:
        return array.detach().as_subclass(torch.Tensor)
    if isinstance(array, np.ndarray) and type(array) is not np.ndarray:
        return np.asarray(array)
    return array


def _array_spec(op: str, name: str, data) -> tuple:
    return _spec_of(_as_plain(_as_array(op, name, data)))


def _check_alike(op: str, specs) -> None:
    """Collectives on arrays need one kind (torch or numpy) and one dtype on every rank."""
    kinds = {(spec[0], spec[1]) for spec in specs}  # (kind, dtype)
    if len(kinds) > 1:
        described = ", ".join(f"{kind} {dtype}" for kind, dtype in sorted(kinds, key=str))
        raise ValueError(f"{op}: every rank must pass the same kind of array with the same dtype, got {described}")


def _scatter_pieces(op: str, xs, size: int) -> list:
    """scatter's xs: a sequence of `size` arrays, or one array whose first dimension is `size`."""
    if isinstance(xs, (torch.Tensor, np.ndarray)):
        if xs.ndim == 0 or xs.shape[0] != size:
            raise ValueError(f"{op}: xs must have {size} rows (one per rank), got shape {tuple(xs.shape)}")
        return [xs[i] for i in range(size)]
    if not isinstance(xs, (tuple, list)) or len(xs) != size:
        raise ValueError(f"{op}: xs must be a tuple or list of {size} arrays (one per rank), got {_describe(xs)}")
    return [_as_array(op, f"xs[{i}]", x) for i, x in enumerate(xs)]


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return type(value).__name__


def _torch_dtype_of(op: str, spec) -> torch.dtype:
    if spec[0] == "torch":
        return spec[1]
    try:
        return torch.from_numpy(np.empty(0, dtype=spec[1])).dtype
    except (TypeError, ValueError):  # no such torch dtype, or not in native byte order
        raise ValueError(f"{op}: numpy dtype {spec[1]} cannot be reduced; use a native numeric dtype") from None


# ---- the communicator -----------------------------------------------------------------------------

class Communicator:
    """ChainerMN's communicator: a chainermn process group plus ChainerMN's methods on it.

    `Communicator(group)` wraps an existing chainermn group (default: the default group) without
    owning it; `create_communicator` and `split` make communicators that own their group, which
    `finalize()` destroys. Other toolkit functions take a communicator wherever torch takes a group
    (they read its `group`).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, _owns_group: bool = False):
        backend_of(group, "Communicator")  # a chainermn group this rank belongs to, or a clear error
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        self._owns_group = _owns_group
        self._finalized = False
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        self._topology = None

    def __repr__(self):
        return (f"Communicator(rank={self.rank}, size={self.size}, communicator_name={self.communicator_name!r}, "
                f"allreduce_grad_dtype={self.allreduce_grad_dtype})")

    # ---- where this rank is
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of processes in the communicator."""
        return self._size

    def _topo(self):
        if self._topology is None:  # fixed for the group's life: ask once
            self._topology = topology(self.group)
        return self._topology

    @property
    def intra_rank(self) -> int:
        """Rank among the processes on this node (pick the GPU with it)."""
        return self._topo().intra_rank

    @property
    def intra_size(self) -> int:
        """Number of processes of the communicator on this node."""
        return self._topo().intra_size

    @property
    def inter_rank(self) -> int:
        """Index of this node among the communicator's nodes."""
        return self._topo().inter_rank

    @property
    def inter_size(self) -> int:
        """Number of nodes the communicator spans."""
        return self._topo().inter_size

    @property
    def communicator_name(self) -> str:
        """The allreduce strategy of the group ("hierarchical", "flat", ...)."""
        return backend_of(self.group, "communicator_name").communicator

    @property
    def allreduce_grad_dtype(self) -> torch.dtype | None:
        """The dtype gradients travel in, or None for their own dtype."""
        name = backend_of(self.group, "allreduce_grad_dtype").allreduce_grad_dtype
        return getattr(torch, name) if name else None

    def _options(self) -> Options:
        return Options(self.communicator_name, self.allreduce_grad_dtype)

    # ---- arrays, point to point
    def send(self, data, dest: int, tag: int = 0) -> None:
        """Send a tensor or numpy array (or a tuple/list of them) to `dest`; it returns from `recv`.
        Tags are ints below RESERVED_TAG (32000; MPI guarantees 32767, the rest is the toolkit's)."""
        op = "send"
        dest = check_rank(op, "dest", dest, self.size)
        tag = _check_tag(op, tag)
        if dest == self.rank:
            raise ValueError(f"{op}: dest must be another rank than this one ({self.rank})")
        if isinstance(data, (tuple, list)):
            data = type(data)(_as_plain(_as_array(op, f"data[{i}]", x)) for i, x in enumerate(data))
        else:
            data = _as_plain(_as_array(op, "data", data))
        send_structured(self.group, data, dest, tag, DEFAULT_MAX_BUF_LEN, op)

    def recv(self, source: int, tag: int = 0):
        """Receive what `source` sent with `send` (shape, dtype and kind travel with the data)."""
        op = "recv"
        source = check_rank(op, "source", source, self.size)
        tag = _check_tag(op, tag)
        if source == self.rank:
            raise ValueError(f"{op}: source must be another rank than this one ({self.rank})")
        return recv_structured(self.group, source, tag, op)

    # ---- arrays, collectives
    def bcast(self, data, max_buf_len: int | None = None, root: int = 0):
        """Rank `root`'s array, on every rank (others' `data` is ignored and may be None)."""
        op = "bcast"
        root = check_rank(op, "root", root, self.size)
        chunk = check_max_buf_len(op, max_buf_len)
        refusal = None
        if self.rank == root:
            try:
                data = _as_plain(_as_array(op, "data", data))
            except ValueError as error:
                refusal = error
        return bcast_structured(self.group, data, root, chunk, op, refusal)

    def gather(self, data, root: int = 0):
        """A tuple of every rank's array (shapes may differ, dtypes may not) on `root`; None elsewhere."""
        op = "gather"
        root = check_rank(op, "root", root, self.size)
        specs = agree(self.group, lambda: _array_spec(op, "data", data))
        _check_alike(op, specs)
        width = max(_nbytes(spec) for spec in specs)
        mine = _padded(_bytes_of(_as_plain(_as_array(op, "data", data))), width)
        received = [_allocate(spec, specs[root][3] if spec[0] == "torch" else None) for spec in specs] \
            if self.rank == root else []
        landings = [_landing(flat, width) for _, flat in received]
        _wait_all([dist.gather(mine[b:e], [landed[b:e] for landed in landings] if self.rank == root else None,
                               group=self.group, group_dst=root, async_op=True)
                   for b, e in _chunks(width, DEFAULT_MAX_BUF_LEN)])
        if self.rank != root:
            return None
        for (array, flat), landed, spec in zip(received, landings, specs):
            _land(flat, landed)
            _finish(array, spec)
        return tuple(array for array, _ in received)

    def allgather(self, data):
        """A tuple of every rank's array (shapes may differ, dtypes may not), on every rank."""
        op = "allgather"
        specs = agree(self.group, lambda: _array_spec(op, "data", data))
        _check_alike(op, specs)
        width = max(_nbytes(spec) for spec in specs)
        mine = _padded(_bytes_of(_as_plain(_as_array(op, "data", data))), width)
        device_type = specs[self.rank][3] if specs[self.rank][0] == "torch" else None
        received = [_allocate(spec, device_type) for spec in specs]
        landings = [_landing(flat, width) for _, flat in received]
        _wait_all([dist.all_gather([landed[b:e] for landed in landings], mine[b:e], group=self.group, async_op=True)
                   for b, e in _chunks(width, DEFAULT_MAX_BUF_LEN)])
        for (array, flat), landed, spec in zip(received, landings, specs):
            _land(flat, landed)
            _finish(array, spec)
        return tuple(array for array, _ in received)

    def scatter(self, xs, root: int = 0):
        """Rank `root` gives rank i its xs[i] (a sequence of `size` arrays of one dtype, or one array
        with `size` rows); every rank returns its piece. Others' `xs` is ignored."""
        op = "scatter"
        root = check_rank(op, "root", root, self.size)
        pieces, specs, refusal = None, None, None
        if self.rank == root:
            try:
                pieces = [_as_plain(p) for p in _scatter_pieces(op, xs, self.size)]
                specs = [_spec_of(p) for p in pieces]
                _check_alike(op, specs)
            except ValueError as error:
                refusal = error
        specs = bcast_structured(self.group, specs, root, DEFAULT_MAX_BUF_LEN, op, refusal)
        width = max(_nbytes(spec) for spec in specs)
        array, flat = _allocate(specs[self.rank])
        landed = _landing(flat, width)
        sends = [_padded(_bytes_of(p), width) for p in pieces] if self.rank == root else None
        _wait_all([dist.scatter(landed[b:e], [s[b:e] for s in sends] if sends else None,
                                group=self.group, group_src=root, async_op=True)
                   for b, e in _chunks(width, DEFAULT_MAX_BUF_LEN)])
        _land(flat, landed)
        return _finish(array, specs[self.rank])

    def alltoall(self, xs):
        """Rank i sends xs[j] to rank j; returns the tuple of what every rank sent to this one."""
        op = "alltoall"

        def describe():
            if not isinstance(xs, (tuple, list)) or len(xs) != self.size:
                raise ValueError(f"{op}: xs must be a tuple or list of {self.size} arrays, got {_describe(xs)}")
            return [_array_spec(op, f"xs[{i}]", x) for i, x in enumerate(xs)]

        rows = agree(self.group, describe)  # rows[source][dest]
        _check_alike(op, [spec for row in rows for spec in row])
        width = max(_nbytes(spec) for row in rows for spec in row)
        sends = [_padded(_bytes_of(_as_plain(_as_array(op, "xs", x))), width) for x in xs]
        device_type = rows[self.rank][0][3] if rows[self.rank][0][0] == "torch" else None
        received = [_allocate(rows[source][self.rank], device_type) for source in range(self.size)]
        landings = [_landing(flat, width) for _, flat in received]
        _wait_all([dist.all_to_all([landed[b:e] for landed in landings], [s[b:e] for s in sends],
                                   group=self.group, async_op=True)
                   for b, e in _chunks(width, DEFAULT_MAX_BUF_LEN)])
        for source, ((array, flat), landed) in enumerate(zip(received, landings)):
            _land(flat, landed)
            _finish(array, rows[source][self.rank])
        return tuple(array for array, _ in received)

    def allreduce(self, data):
        """The element-wise sum of every rank's array (same shape and dtype everywhere), as a new
        array on every rank; `data` is left unchanged (ChainerMN's allreduce: SUM only)."""
        op = "allreduce"
        specs = agree(self.group, lambda: _array_spec(op, "data", data))
        _check_alike(op, specs)
        shapes = {spec[2] for spec in specs}
        if len(shapes) > 1:
            raise ValueError(f"{op}: every rank must pass the same shape, got {sorted(shapes)}")
        _torch_dtype_of(op, specs[0])
        array = _as_plain(_as_array(op, "data", data))
        if isinstance(array, torch.Tensor):
            result = array.detach().clone(memory_format=torch.contiguous_format)
            flat = result.reshape(-1)
        else:
            result = np.array(array, order="C", copy=True)
            flat = torch.from_numpy(result.reshape(-1))
        per_chunk = max(1, DEFAULT_MAX_BUF_LEN // max(1, flat.element_size()))
        _wait_all([dist.all_reduce(flat[b:e], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                   for b, e in _chunks(flat.numel(), per_chunk)])
        return result

    # ---- Python objects
    def send_obj(self, obj, dest: int, tag: int = 0) -> None:
        """Send any picklable object to `dest`; it returns from `recv_obj`."""
        op = "send_obj"
        dest = check_rank(op, "dest", dest, self.size)
        tag = _check_tag(op, tag)
        if dest == self.rank:
            raise ValueError(f"{op}: dest must be another rank than this one ({self.rank})")
        send_structured(self.group, obj, dest, tag, DEFAULT_MAX_BUF_LEN, op)

    def recv_obj(self, source: int, tag: int = 0):
        """Receive the object `source` sent with `send_obj` (or `send`)."""
        op = "recv_obj"
        source = check_rank(op, "source", source, self.size)
        tag = _check_tag(op, tag)
        if source == self.rank:
            raise ValueError(f"{op}: source must be another rank than this one ({self.rank})")
        return recv_structured(self.group, source, tag, op)

    def bcast_obj(self, obj, max_buf_len: int | None = None, root: int = 0):
        """Rank `root`'s object, on every rank, sent in chunks of at most `max_buf_len` bytes
        (default 256 MiB), so objects over 2 GiB work."""
        op = "bcast_obj"
        root = check_rank(op, "root", root, self.size)
        chunk = check_max_buf_len(op, max_buf_len)
        return bcast_structured(self.group, obj, root, chunk, op)

    def gather_obj(self, obj, root: int = 0, max_buf_len: int | None = None):
        """The list of every rank's object, in rank order, on `root`; None elsewhere."""
        op = "gather_obj"
        root = check_rank(op, "root", root, self.size)
        chunk = check_max_buf_len(op, max_buf_len)
        objs, failures, own_failure = self._gather_to_root(op, obj, root, chunk)
        if own_failure is not None:
            raise own_failure
        if failures:
            raise RuntimeError(f"{op}: " + "; ".join(failures))
        return objs

    def allreduce_obj(self, obj, max_buf_len: int | None = None):
        """The sum (Python `+`, in rank order) of every rank's object, on every rank; identical
        everywhere because the root adds and broadcasts the result."""
        op = "allreduce_obj"
        chunk = check_max_buf_len(op, max_buf_len)
        objs, failures, own_failure = self._gather_to_root(op, obj, 0, chunk)
        total, failure = None, None
        if self.rank == 0:
            if failures:
                failure = RuntimeError("; ".join(failures))
            else:
                try:
                    total = functools.reduce(operator.add, objs)
                except Exception as error:  # noqa: BLE001  every rank must learn of it
                    failure = error
        try:
            total = bcast_structured(self.group, total, 0, chunk, op, failure)
        except (ValueError, RuntimeError):
            if own_failure is None:
                raise
        if own_failure is not None:  # this rank's own error says more than the root's report of it
            raise own_failure
        return total

    def _gather_to_root(self, op: str, obj, root: int, chunk: int):
        """On root: (objects in rank order, reasons of the ranks that failed, None). Elsewhere:
        (None, [], this rank's failure to send or None), so that it can still join what follows."""
        if self.rank != root:
            try:
                send_structured(self.group, obj, root, TAG_GATHER_OBJ, chunk, op)
            except Exception as error:  # noqa: BLE001  the root was told; raised by the caller
                return None, [], error
            return None, [], None
        objs, failures = [], []
        for source in range(self.size):
            if source == root:
                objs.append(obj)
                continue
            try:
                objs.append(recv_structured(self.group, source, TAG_GATHER_OBJ, op))
            except (ValueError, RuntimeError) as error:
                objs.append(None)
                failures.append(str(error))
        return objs, failures, None

    # ---- models
    def bcast_data(self, model: torch.nn.Module) -> None:
        """Make every rank's parameters rank 0's: one packed broadcast per dtype (ChainerMN's
        bcast_data; buffers are not touched, as in ChainerMN)."""
        op = "bcast_data"
        params = [param for _, param in _named_parameters(op, model)]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for param in params:  # first-seen order is the same on every rank: the names are sorted
            groups.setdefault((param.device, param.dtype), []).append(param)
        for tensors in groups.values():
            with torch.no_grad():
                packed = torch._utils._flatten_dense_tensors([t.detach() for t in tensors])
                _bcast_raw(self.group, packed.view(torch.uint8), 0, DEFAULT_MAX_BUF_LEN)
                if self.rank != 0:
                    for tensor, value in zip(tensors, torch._utils._unflatten_dense_tensors(packed, tensors)):
                        tensor.copy_(value)

    def multi_node_mean_grad(self, model: torch.nn.Module, zero_fill: bool = False, async_op: bool = False):
        """Replace every gradient by its mean over the communicator, in one packed call (ChainerMN's
        allreduce_grad / multi_node_mean_grad), travelling in the group's allreduce_grad_dtype.

        Parameters are visited in sorted-name order; frozen and lazy (uninitialised) ones are skipped.
        A None gradient is skipped (every rank must agree), or with `zero_fill` replaced by zeros that
        take part, so afterwards it holds the mean. Returns the Work when async_op, else None.
        """
        op = "multi_node_mean_grad"
        grads = []
        for _, param in _named_parameters(op, model):
            if not param.requires_grad:
                continue
            if param.grad is None:
                if not zero_fill:
                    continue
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        return mean_coalesced(grads, group=self.group, async_op=async_op)

    allreduce_grad = multi_node_mean_grad

    # ---- groups
    def split(self, color, key: int):
        """A new Communicator of the ranks that pass the same `color`, ranked by `key` (ties: by this
        communicator's rank), with this communicator's options; MPI_Comm_split's semantics.

        Collective over this communicator. A rank passing color=None joins no group and gets None.
        """
        op = "split"
        for name, value in (("color", color), ("key", key)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                if not (name == "color" and value is None):
                    raise ValueError(f"{op}: {name} must be an int, got {value!r}")
        everyone = allgather_small(self.group, (None if color is None else int(color), int(key)))
        options = self._options()
        whole_world = self.size == dist.get_world_size()
        mine = None
        for this_color in sorted({c for c, _ in everyone if c is not None}):
            members = sorted((k, rank) for rank, (c, k) in enumerate(everyone) if c == this_color)
            global_ranks = [dist.get_global_rank(self.group, rank) for _, rank in members]
            if whole_world:
                # torch wants every process of the job in new_group, member or not, in the same order.
                group = dist.new_group(global_ranks, backend="chainermn", pg_options=options, sort_ranks=False)
            elif this_color == color:
                # Ranks outside this communicator never get here: synchronise among the members only.
                group = dist.new_group(global_ranks, backend="chainermn", pg_options=options, sort_ranks=False,
                                       use_local_synchronization=True)
            else:
                continue
            if this_color == color:
                mine = group
        return None if mine is None else Communicator(mine, _owns_group=True)

    def finalize(self) -> None:
        """Destroy the group this communicator created (a wrapped or default group is left alone).
        Calling it again does nothing."""
        if self._owns_group and not self._finalized:
            dist.destroy_process_group(self.group)
        self._finalized = True

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.finalize()


def _named_parameters(op: str, model):
    """(name, parameter) in sorted-name order, without lazy (uninitialised) parameters."""
    if not hasattr(model, "named_parameters"):
        raise ValueError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    return [(name, param) for name, param in sorted(model.named_parameters(), key=lambda item: item[0])
            if not isinstance(param, torch.nn.parameter.UninitializedParameter)]


def _grad_dtype_option(value):
    """ChainerMN passes numpy dtypes (numpy.float16); Options takes torch dtypes or names."""
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return np.dtype(value).name
    return value


def _launched() -> bool:
    """Whether a launcher (torchrun, or mpiexec through our import) told this process its rank."""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


def create_communicator(communicator_name: str = "hierarchical", allreduce_grad_dtype=None) -> Communicator:
    """Create a ChainerMN communicator: a chainermn process group with these options.

    communicator_name: "naive", "flat", "hierarchical", "two_dimensional", "single_node" or "pure_nccl".
    allreduce_grad_dtype: the dtype gradients travel in (torch or numpy dtype, or its name); None keeps
        the gradients' own dtype (unless $CHAINERMN_ALLREDUCE_GRAD_DTYPE says otherwise).

    Without a process group yet, this initialises torch.distributed with the chainermn backend (under
    torchrun or mpiexec; a process started by neither runs as a world of one, as ChainerMN did) and the
    communicator uses the default group. Otherwise it makes a new chainermn group over all ranks,
    collectively (every rank must call it), which `finalize()` destroys.
    """
    op = "create_communicator"
    if not isinstance(communicator_name, str):
        raise ValueError(f"{op}: communicator_name must be a str, got {type(communicator_name).__name__}")
    try:
        options = Options(communicator_name, _grad_dtype_option(allreduce_grad_dtype))
    except ValueError as error:
        raise ValueError(f"{op}: {error}") from None
    if not dist.is_initialized():
        if _launched():
            dist.init_process_group("chainermn", pg_options=options)
        else:
            dist.init_process_group("chainermn", store=dist.HashStore(), rank=0, world_size=1, pg_options=options)
        return Communicator()
    group = dist.new_group(backend="chainermn", pg_options=options)
    return Communicator(group, _owns_group=True)
