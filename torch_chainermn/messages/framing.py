"""Tags, argument checks, chunks and waits: what every message of the toolkit is framed with.

Anything over 2 GiB must be chunked (one MPI message counts at most INT_MAX elements), so bytes
travel in chunks of at most a chunk size, each chunk its own point-to-point or collective call.
"""

from __future__ import annotations

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


# ---- argument checks ------------------------------------------------------------------------------


def check_rank(op: str, name: str, value, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < size:
        raise ValueError(f"{op}: {name} must be a rank in [0, {size}), got {value!r}")
    return int(value)


def check_tag(op: str, tag) -> int:
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


# ---- waits ----------------------------------------------------------------------------------------


def wait_all(works, what: str | None = None, hint: str = "") -> None:
    """Wait for every Work in turn. With `what` (the op, and what it was waiting for), a failure of
    the backend (DistBackendError: a timeout, a peer that died, a group broken by either) is raised
    again as a DistBackendError that says what never came, then `hint`, then the backend's words."""
    for work in works:
        if what is None:
            work.wait()
            continue
        try:
            work.wait()
        except dist.DistBackendError as error:
            said = f"{what}. {hint}" if hint else f"{what}."
            raise dist.DistBackendError(f"{said}\n(the backend said: {error})") from error


# ---- raw bytes, chunked ---------------------------------------------------------------------------


def chunks(nbytes: int, chunk: int):
    return [(start, min(start + chunk, nbytes)) for start in range(0, nbytes, chunk)]


def bytes_view(data: bytes) -> torch.Tensor:
    """A uint8 tensor over `data` without a copy (it is only sent from, never written)."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def send_bytes(group, flat: torch.Tensor, peer: int, tag: int, chunk: int) -> None:
    wait_all([dist.isend(flat[b:e], group=group, group_dst=peer, tag=tag) for b, e in chunks(flat.numel(), chunk)])


def recv_bytes(group, flat: torch.Tensor, peer: int, tag: int, chunk: int) -> None:
    wait_all([dist.irecv(flat[b:e], group=group, group_src=peer, tag=tag) for b, e in chunks(flat.numel(), chunk)])


def bcast_bytes(group, flat: torch.Tensor, root: int, chunk: int) -> None:
    wait_all(
        [dist.broadcast(flat[b:e], group=group, group_src=root, async_op=True) for b, e in chunks(flat.numel(), chunk)]
    )
