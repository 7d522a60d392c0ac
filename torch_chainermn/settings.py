"""Every environment variable torch-chainermn reads, in one table (docs/settings.md's table is checked
against it by tests/test_settings.py, and so is every CHAINERMN_* name in the sources).

scope: "group" variables are the defaults of a group's `Options` field (read by
`options.environment_defaults()`); "process" variables hold for the whole process; "build" ones are
read by setup.py. Where a variable is read is its `read_by`; the C++ backend reads none: it is handed the values.
"""

from __future__ import annotations

import os
import socket
from typing import NamedTuple


class Variable(NamedTuple):
    name: str
    scope: str  # "group" (an Options field's default), "process" or "build"
    field: str | None  # the Options field, for scope "group"
    default: str | None
    what: str
    read_by: str


VARIABLES: tuple[Variable, ...] = (
    Variable("CHAINERMN_COMMUNICATOR", "group", "communicator", "hierarchical", "the allreduce strategy", "options.py"),
    Variable(
        "CHAINERMN_ALLREDUCE_GRAD_DTYPE",
        "group",
        "allreduce_grad_dtype",
        None,
        "gradients' wire dtype (float16, bfloat16, ...); unset: their own",
        "options.py",
    ),
    Variable(
        "CHAINERMN_TRANSPORT",
        "group",
        "transport",
        "auto",
        "the library between ranks: mpi, gloo, or auto (MPI when every rank can)",
        "options.py",
    ),
    Variable(
        "CHAINERMN_SHM",
        "group",
        "shared_memory",
        "1",
        "intra-node CPU collectives and point to point through shared memory (0/1)",
        "options.py",
    ),
    Variable(
        "CHAINERMN_CUDA_TRANSPORT",
        "group",
        "cuda_transport",
        "nccl",
        "how CUDA tensors travel: nccl, nccl_intra, staged",
        "options.py",
    ),
    # torch's own convention: unset is INFO (every collective's fingerprint is checked), DETAIL adds
    # every tensor's shape, OFF (set explicitly) turns the checks off.
    Variable(
        "TORCH_DISTRIBUTED_DEBUG",
        "group",
        "checks",
        "info",
        "cross-rank checks before every collective: OFF, INFO, DETAIL",
        "options.py",
    ),
    Variable(
        "CHAINERMN_RANKS_PER_NODE",
        "process",
        None,
        None,
        "act as nodes of k ranks on one machine (node = global rank // k)",
        "settings.py",
    ),
    Variable(
        "CHAINERMN_HOSTNAME", "process", None, None, "this process's node name, in place of the host's", "settings.py"
    ),
    Variable(
        "CHAINERMN_SHM_CHUNK_BYTES",
        "process",
        None,
        "1048576",
        "the shared-memory collectives' chunk (at least 4096)",
        "settings.py",
    ),
    Variable(
        "CHAINERMN_STRAGGLER_WINDOW",
        "process",
        None,
        "16",
        "collectives the stragglers' summary covers (at least 2)",
        "settings.py",
    ),
    Variable(
        "CHAINERMN_STRAGGLER_MARGIN_MS",
        "process",
        None,
        "5",
        "the mean lateness (ms) that names a rank last in most of the window",
        "settings.py",
    ),
    Variable(
        "CHAINERMN_STRAGGLER_WARN",
        "process",
        None,
        "1",
        "rank 0 logs one line when a straggler is named (0/1)",
        "settings.py",
    ),
    Variable(
        "CHAINERMN_FORCE_ABORT_ON_EXCEPTION",
        "process",
        None,
        None,
        "install the global except hook at import (ChainerMN's name; ...EXCEPTIONS too)",
        "settings.py",
    ),
    Variable(
        "CHAINERMN_FORCE_ABORT_ON_EXCEPTIONS",
        "process",
        None,
        None,
        "the same as CHAINERMN_FORCE_ABORT_ON_EXCEPTION",
        "settings.py",
    ),
    Variable(
        "CHAINERMN_NO_CUDA", "build", None, None, "build a CUDA torch's extension without the CUDA path", "setup.py"
    ),
    Variable("CHAINERMN_NO_MPI", "build", None, None, "build without MPI even where mpicc is found", "setup.py"),
    Variable(
        "CHAINERMN_DEBUG_INFO",
        "build",
        None,
        None,
        "1: compile with debug information (-g); builds leave it out, a third faster",
        "setup.py",
    ),
    Variable(
        "CHAINERMN_TESTING",
        "build",
        None,
        None,
        "1: a test build, with the in-process harnesses (_C.testing) the tests use; `make` sets it",
        "setup.py",
    ),
)

BY_NAME = {variable.name: variable for variable in VARIABLES}


def group_variables() -> dict:
    """Options field -> (variable, default when unset), for options.environment_defaults()."""
    return {v.field: (v.name, v.default) for v in VARIABLES if v.scope == "group"}


def _set(name: str) -> str | None:
    value = os.environ.get(name, "")
    return value if value != "" else None


def node_name(global_rank: int) -> str:
    """The node this process reports to its group: CHAINERMN_HOSTNAME, else a simulated node of
    CHAINERMN_RANKS_PER_NODE ranks (global rank // k), else the host's name."""
    name = _set("CHAINERMN_HOSTNAME")
    if name is not None:
        return name
    per_node = _set("CHAINERMN_RANKS_PER_NODE")
    if per_node is not None:
        if not per_node.isdigit() or int(per_node) <= 0:
            raise ValueError(f"CHAINERMN_RANKS_PER_NODE must be a positive integer, got {per_node!r}")
        return f"simulated-node-{global_rank // int(per_node)}"
    return socket.gethostname()


def shm_chunk_bytes() -> int:
    """The shared-memory collectives' chunk in bytes (CHAINERMN_SHM_CHUNK_BYTES, default 1 MiB)."""
    text = _set("CHAINERMN_SHM_CHUNK_BYTES")
    if text is None:
        return int(BY_NAME["CHAINERMN_SHM_CHUNK_BYTES"].default)
    if not text.isdigit() or int(text) < 4096:
        raise ValueError(f"CHAINERMN_SHM_CHUNK_BYTES must be an integer of at least 4096, got {text!r}")
    return int(text)


def stragglers() -> tuple[int, float, bool]:
    """(window, margin in ms, warn) of the stragglers' summary (CHAINERMN_STRAGGLER_WINDOW, _MARGIN_MS,
    _WARN; docs/observability.md#stragglers)."""
    window = _set("CHAINERMN_STRAGGLER_WINDOW") or BY_NAME["CHAINERMN_STRAGGLER_WINDOW"].default
    if not window.isdigit() or int(window) < 2:
        raise ValueError(f"CHAINERMN_STRAGGLER_WINDOW must be an integer of at least 2, got {window!r}")
    margin = _set("CHAINERMN_STRAGGLER_MARGIN_MS") or BY_NAME["CHAINERMN_STRAGGLER_MARGIN_MS"].default
    try:
        margin_ms = float(margin)
    except ValueError:
        margin_ms = -1.0
    if not margin_ms >= 0:  # also refuses nan
        raise ValueError(f"CHAINERMN_STRAGGLER_MARGIN_MS must be a number of milliseconds >= 0, got {margin!r}")
    warn = _set("CHAINERMN_STRAGGLER_WARN") or BY_NAME["CHAINERMN_STRAGGLER_WARN"].default
    if warn not in ("0", "1"):
        raise ValueError(f"CHAINERMN_STRAGGLER_WARN must be 0 or 1, got {warn!r}")
    return int(window), margin_ms, warn == "1"


def abort_on_exception_requested() -> bool:
    """Whether CHAINERMN_FORCE_ABORT_ON_EXCEPTION[S] asks for the global except hook at import: set to
    anything but "" or "0"."""
    return any(
        os.environ.get(name, "") not in ("", "0")
        for name in ("CHAINERMN_FORCE_ABORT_ON_EXCEPTION", "CHAINERMN_FORCE_ABORT_ON_EXCEPTIONS")
    )
