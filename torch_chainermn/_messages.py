"""The wire protocol of the communicator object, scatter_dataset and the iterators.

How things travel. Objects are pickled, except that dense tensors and numeric arrays inside them are
lifted out of the pickle and sent as raw bytes (exact, no copy through pickle's byte string). A
message is a header, `[status, nbytes, chunk]`, then the bytes in chunks of at most `max_buf_len`
(MPI counts are C ints, so anything over 2 GiB must be chunked). A rank that cannot take part (bad
argument on the root, an object that does not pickle) still sends a header, with a failure status
and the reason, so the other ranks raise too instead of waiting for data that never comes.
"""
from __future__ import annotations

import io
import pickle
import warnings

import numpy as np
import torch
import torch.distributed as dist

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
