"""The communicator's array collectives (gather, allgather, scatter, alltoall) as one exchange.

Each is the same few steps around a different torch collective: the ranks have agreed on every
array's spec; what this rank sends is padded to the widest array (collectives move equal sizes);
what it receives is allocated, landing in a buffer that wide where its own bytes are fewer; the
collective runs chunk by chunk (MPI counts are C ints); the landed bytes are copied into place and
the arrays finished.
"""

from __future__ import annotations

from .arrays import allocate, bytes_of, finish, land, landing, padded
from .framing import DEFAULT_MAX_BUF_LEN, chunks, wait_all


def exchange(collective, sends, receive_specs, width: int, device_type: str | None = None) -> list:
    """Run `collective(send_chunks, landing_chunks)` (it returns an async Work) over every chunk of
    `width` bytes: `sends` are this rank's arrays (plain, checked), `receive_specs` the specs of the
    arrays it receives, allocated on `device_type` (None: each spec's own). Returns those arrays."""
    outgoing = [padded(bytes_of(array), width) for array in sends]
    received = [allocate(spec, device_type) for spec in receive_specs]
    landings = [landing(flat, width) for _, flat in received]
    wait_all(
        [
            collective([flat[b:e] for flat in outgoing], [flat[b:e] for flat in landings])
            for b, e in chunks(width, DEFAULT_MAX_BUF_LEN)
        ]
    )
    for (array, flat), landed, spec in zip(received, landings, receive_specs):
        land(flat, landed)
        finish(array, spec)
    return [array for array, _ in received]
