"""Per-group options of the chainermn backend, passed as `pg_options`.

    dist.init_process_group("chainermn", pg_options=torch_chainermn.Options(communicator="two_dimensional"))
    dist.new_group(ranks, backend="chainermn", pg_options=torch_chainermn.Options(communicator="flat"))

Without options, CHAINERMN_COMMUNICATOR and CHAINERMN_ALLREDUCE_GRAD_DTYPE give the defaults, so a
launch can switch strategy with no code change.
"""
from __future__ import annotations

import os

import torch

from . import _C

COMMUNICATORS: tuple[str, ...] = tuple(_C.communicator_names)
DEFAULT_COMMUNICATOR = "hierarchical"  # ChainerMN's default

# Wire dtypes for gradients, by the names torch gives them.
WIRE_DTYPES = {
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "double": torch.float64,
}


def _wire_dtype(value) -> torch.dtype | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        key = value.removeprefix("torch.")
        if key in WIRE_DTYPES:
            return WIRE_DTYPES[key]
    elif isinstance(value, torch.dtype) and value.is_floating_point and value in WIRE_DTYPES.values():
        return value
    raise ValueError(
        f"allreduce_grad_dtype must be None or a floating dtype of {sorted(set(WIRE_DTYPES))}, got {value!r}")


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "" if dtype is None else str(dtype).removeprefix("torch.")


class Options:
    """How a chainermn group reduces.

    communicator: one of "naive", "flat", "hierarchical", "two_dimensional", "single_node",
        "pure_nccl" (ChainerMN's communicators). Default: $CHAINERMN_COMMUNICATOR or "hierarchical".
    allreduce_grad_dtype: the dtype gradients travel in (float16 or bfloat16 halve the bytes); None
        keeps each gradient's own dtype. Default: $CHAINERMN_ALLREDUCE_GRAD_DTYPE or None.
    """

    __slots__ = ("_communicator", "_allreduce_grad_dtype")

    def __init__(self, communicator: str | None = None, allreduce_grad_dtype=None):
        if communicator is None:
            communicator = os.environ.get("CHAINERMN_COMMUNICATOR") or DEFAULT_COMMUNICATOR
        if communicator not in COMMUNICATORS:
            raise ValueError(f"unknown chainermn communicator {communicator!r}; choose from {', '.join(COMMUNICATORS)}")
        if allreduce_grad_dtype is None:
            allreduce_grad_dtype = os.environ.get("CHAINERMN_ALLREDUCE_GRAD_DTYPE")
        self._communicator = communicator
        self._allreduce_grad_dtype = _wire_dtype(allreduce_grad_dtype)

    @property
    def communicator(self) -> str:
        return self._communicator

    @property
    def allreduce_grad_dtype(self) -> torch.dtype | None:
        return self._allreduce_grad_dtype

    def __eq__(self, other):
        return isinstance(other, Options) and (self.communicator, self.allreduce_grad_dtype) == (
            other.communicator, other.allreduce_grad_dtype)

    def __hash__(self):
        return hash((self.communicator, self.allreduce_grad_dtype))

    def __repr__(self):
        return f"Options(communicator={self.communicator!r}, allreduce_grad_dtype={self.allreduce_grad_dtype})"
