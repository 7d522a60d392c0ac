"""Tensors and numpy arrays as raw bytes: what travels is the bytes, what is said about them is a spec.

A spec says how to rebuild an array from its bytes:
    ("torch", dtype, shape, device_type, requires_grad) or ("numpy", dtype, shape).
Collectives move equal sizes from every rank, so arrays of different sizes travel padded to the
widest and land in a buffer that wide before their own bytes are copied out.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch


def is_raw_array(obj) -> bool:
    """Arrays that travel as raw bytes: plain dense tensors and numpy arrays without Python objects."""
    if type(obj) is torch.Tensor:
        return obj.layout == torch.strided and not obj.is_quantized and not obj.is_nested and not obj.is_meta
    return type(obj) is np.ndarray and not obj.dtype.hasobject


def spec_of(array) -> tuple:
    if isinstance(array, torch.Tensor):
        return ("torch", array.dtype, tuple(array.shape), array.device.type, array.requires_grad)
    return ("numpy", array.dtype, array.shape)


def nbytes(spec) -> int:
    count = int(np.prod(spec[2], dtype=np.int64))
    return count * spec[1].itemsize


def bytes_of(array) -> torch.Tensor:
    """The array's bytes as a flat uint8 tensor, without a copy where it is already contiguous."""
    if isinstance(array, torch.Tensor):
        flat = array.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        return flat.view(torch.uint8)
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays: we only send from them
        return torch.from_numpy(flat)


def allocate(spec, device_type: str | None = None):
    """An empty array for `spec` and a flat uint8 tensor over its memory, to receive into."""
    if spec[0] == "torch":
        _, dtype, shape, own_device_type, _ = spec
        tensor = torch.empty(shape, dtype=dtype, device=torch.device(device_type or own_device_type))
        return tensor, tensor.reshape(-1).view(torch.uint8)
    _, dtype, shape = spec
    array = np.empty(shape, dtype=dtype)
    return array, torch.from_numpy(array.reshape(-1).view(np.uint8))


def finish(array, spec):
    """The received array as the sender had it (a tensor that required grad requires it again)."""
    if spec[0] == "torch" and spec[4]:
        array.requires_grad_(True)
    return array


# ---- padded to a common width ---------------------------------------------------------------------


def padded(flat: torch.Tensor, width: int) -> torch.Tensor:
    """`flat` widened to `width` bytes (collectives move equal sizes from every rank)."""
    if flat.numel() == width:
        return flat
    out = torch.zeros(width, dtype=torch.uint8, device=flat.device)
    out[: flat.numel()] = flat
    return out


def landing(flat: torch.Tensor, width: int) -> torch.Tensor:
    """Where `width` bytes land before the first flat.numel() of them go to `flat`."""
    return flat if flat.numel() == width else torch.empty(width, dtype=torch.uint8, device=flat.device)


def land(flat: torch.Tensor, landed: torch.Tensor) -> None:
    if landed is not flat:
        flat.copy_(landed[: flat.numel()])


# ---- data arguments -------------------------------------------------------------------------------


def as_array(op: str, name: str, data):
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


def as_plain(array):
    """Tensors that are subclasses (e.g. Parameter) travel as plain tensors of the same data."""
    if isinstance(array, torch.Tensor) and type(array) is not torch.Tensor:
        return array.detach().as_subclass(torch.Tensor)
    if isinstance(array, np.ndarray) and type(array) is not np.ndarray:
        return np.asarray(array)
    return array


def plain_array(op: str, name: str, data):
    """`data` checked (as_array) and as a plain tensor or array (as_plain)."""
    return as_plain(as_array(op, name, data))


def array_spec(op: str, name: str, data) -> tuple:
    return spec_of(plain_array(op, name, data))


def check_alike(op: str, specs) -> None:
    """Collectives on arrays need one kind (torch or numpy) and one dtype on every rank."""
    kinds = {(spec[0], spec[1]) for spec in specs}  # (kind, dtype)
    if len(kinds) > 1:
        described = ", ".join(f"{kind} {dtype}" for kind, dtype in sorted(kinds, key=str))
        raise ValueError(f"{op}: every rank must pass the same kind of array with the same dtype, got {described}")


def scatter_pieces(op: str, xs, size: int) -> list:
    """scatter's xs: a sequence of `size` arrays, or one array whose first dimension is `size`."""
    if isinstance(xs, (torch.Tensor, np.ndarray)):
        if xs.ndim == 0 or xs.shape[0] != size:
            raise ValueError(f"{op}: xs must have {size} rows (one per rank), got shape {tuple(xs.shape)}")
        return [xs[i] for i in range(size)]
    if not isinstance(xs, (tuple, list)) or len(xs) != size:
        raise ValueError(f"{op}: xs must be a tuple or list of {size} arrays (one per rank), got {describe(xs)}")
    return [as_array(op, f"xs[{i}]", x) for i, x in enumerate(xs)]


def describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return type(value).__name__


def torch_dtype_of(op: str, spec) -> torch.dtype:
    if spec[0] == "torch":
        return spec[1]
    try:
        return torch.from_numpy(np.empty(0, dtype=spec[1])).dtype
    except (TypeError, ValueError):  # no such torch dtype, or not in native byte order
        raise ValueError(f"{op}: numpy dtype {spec[1]} cannot be reduced; use a native numeric dtype") from None
