"""Per-group options of the chainermn backend, passed as `pg_options`.

    dist.init_process_group("chainermn", pg_options=torch_chainermn.Options(communicator="two_dimensional"))
    dist.new_group(ranks, backend="chainermn", pg_options=torch_chainermn.Options(communicator="flat"))

Every per-group setting is here, and `environment_defaults()` is the one place the environment is
read: a setting left as None takes its CHAINERMN_* variable, so a launch can switch strategy or
transport with no code change. The C++ backend holds the same fields (`_C.GroupOptions`).
"""

from __future__ import annotations

import os

import torch

from . import _C
from .settings import group_variables

COMMUNICATORS: tuple[str, ...] = tuple(_C.communicator_names)
TRANSPORTS: tuple[str, ...] = ("auto", "mpi", "gloo")
CHECKS: tuple[str, ...] = ("off", "info", "detail")  # torch's debug levels
CUDA_TRANSPORTS: tuple[str, ...] = tuple(_C.cuda_transports)

# Wire dtypes for gradients, by the names torch gives them.
WIRE_DTYPES = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
}

# field -> (environment variable, default when it is unset): from the one table of variables.
ENVIRONMENT = group_variables()


def environment_defaults() -> dict:
    """Every per-group setting as the environment gives it (raw strings, validated by Options)."""
    return {field: os.environ.get(variable) or default for field, (variable, default) in ENVIRONMENT.items()}


def wire_dtype(value, what: str = "allreduce_grad_dtype") -> torch.dtype | None:
    """A wire dtype for gradients (a torch.dtype or its name, "torch." or not), or None; the one
    check of them (Options, mean_coalesced, the double-buffering hook): a ValueError naming `what`."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        key = value.removeprefix("torch.")
        if key in WIRE_DTYPES:
            return WIRE_DTYPES[key]
    elif isinstance(value, torch.dtype) and value.is_floating_point and value in WIRE_DTYPES.values():
        return value
    raise ValueError(f"{what} must be None or a floating dtype of {sorted(set(WIRE_DTYPES))}, got {value!r}")


def _choice(field: str, value, allowed: tuple[str, ...]) -> str:
    text = str(value).lower()
    if text not in allowed:
        variable = ENVIRONMENT[field][0]
        raise ValueError(f"{field} ({variable}) must be one of {', '.join(allowed)}, got {value!r}")
    return text


def _switch(field: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if value not in ("0", "1"):
        raise ValueError(f"{field} ({ENVIRONMENT[field][0]}) must be 0 or 1, got {value!r}")
    return value == "1"


class Options:
    """How a chainermn group communicates. A setting left as None takes its environment variable.

    communicator: one of "naive", "flat", "hierarchical", "two_dimensional", "single_node",
        "pure_nccl" (ChainerMN's communicators). $CHAINERMN_COMMUNICATOR, else "hierarchical".
    allreduce_grad_dtype: the dtype gradients travel in (float16 or bfloat16 halve the bytes); None
        keeps each gradient's own dtype. $CHAINERMN_ALLREDUCE_GRAD_DTYPE, else None.
    transport: the library between ranks: "mpi" (only under mpiexec), "gloo", or "auto" (MPI when
        every rank can use it). $CHAINERMN_TRANSPORT, else "auto".
    shared_memory: intra-node CPU collectives through shared memory. $CHAINERMN_SHM (0/1), else on.
    cuda_transport: how CUDA tensors travel: "nccl", "nccl_intra" (NCCL within a node, the host
        library staged through pinned memory between nodes) or "staged". $CHAINERMN_CUDA_TRANSPORT,
        else "nccl".
    checks: what the ranks compare before every collective, so that mismatched calls raise on every
        rank instead of returning wrong data: "info" (op, dtype, sizes, root, reduce op, collective
        number), "detail" (also every tensor's shape) or "off". $TORCH_DISTRIBUTED_DEBUG, else "info".
    """

    __slots__ = ("_communicator", "_allreduce_grad_dtype", "_transport", "_shared_memory", "_cuda_transport", "_checks")

    def __init__(
        self,
        communicator: str | None = None,
        allreduce_grad_dtype=None,
        *,
        transport: str | None = None,
        shared_memory: bool | None = None,
        cuda_transport: str | None = None,
        checks: str | None = None,
    ):
        given = {
            "communicator": communicator,
            "allreduce_grad_dtype": allreduce_grad_dtype,
            "transport": transport,
            "shared_memory": shared_memory,
            "cuda_transport": cuda_transport,
            "checks": checks,
        }
        if any(value is None for value in given.values()):
            defaults = environment_defaults()
            given = {field: defaults[field] if value is None else value for field, value in given.items()}
        self._set(given)

    def _set(self, given: dict) -> None:
        if given["communicator"] not in COMMUNICATORS:
            raise ValueError(
                f"unknown chainermn communicator {given['communicator']!r}; choose from {', '.join(COMMUNICATORS)}"
            )
        self._communicator = given["communicator"]
        self._allreduce_grad_dtype = wire_dtype(given["allreduce_grad_dtype"])
        self._transport = _choice("transport", given["transport"], TRANSPORTS)
        self._shared_memory = _switch("shared_memory", given["shared_memory"])
        self._cuda_transport = _choice("cuda_transport", given["cuda_transport"], CUDA_TRANSPORTS)
        self._checks = _choice("checks", given["checks"], CHECKS)

    communicator = property(lambda self: self._communicator)
    allreduce_grad_dtype = property(lambda self: self._allreduce_grad_dtype)
    transport = property(lambda self: self._transport)
    shared_memory = property(lambda self: self._shared_memory)
    cuda_transport = property(lambda self: self._cuda_transport)
    checks = property(lambda self: self._checks)

    def _fields(self) -> tuple:
        return (
            self.communicator,
            self.allreduce_grad_dtype,
            self.transport,
            self.shared_memory,
            self.cuda_transport,
            self.checks,
        )

    def to_cpp(self) -> _C.GroupOptions:
        """The same settings as the C++ backend holds them."""
        held = _C.GroupOptions()
        (
            held.communicator,
            held.allreduce_grad_dtype,
            held.transport,
            held.shared_memory,
            held.cuda_transport,
            held.checks,
        ) = self._fields()
        return held

    @classmethod
    def from_cpp(cls, held: _C.GroupOptions) -> Options:
        """What a group holds, as is: a None there is not replaced by the environment's default."""
        options = cls.__new__(cls)
        options._set({field: getattr(held, field) for field in ENVIRONMENT})
        return options

    def __eq__(self, other):
        return isinstance(other, Options) and self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        return (
            f"Options(communicator={self.communicator!r}, allreduce_grad_dtype={self.allreduce_grad_dtype}, "
            f"transport={self.transport!r}, shared_memory={self.shared_memory}, "
            f"cuda_transport={self.cuda_transport!r}, checks={self.checks!r})"
        )
