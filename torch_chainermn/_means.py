"""How a mean travels: the one place that turns what a user passed as `compression=` into the object
that starts the mean and keeps its state.

What a user may pass (the DDP hooks' states, the multi-node optimizer, the communicator, DiLoCo and
the overlap all take the same):
    None                  a plain mean in the caller's default wire dtype (see WireMean)
    torch.float16, ...    a plain mean in that wire dtype (options.WIRE_DTYPES, the one list)
    {"code": "int8", ...} compression.GradientCompression's settings, for the caller's group
                          ({"type": ...}: the code's old key, deprecated)
    CompressionSpec("int8", block=256)   the same, as one value (torch_chainermn.codes)
    GradientCompression   used as it is (hooks.GradientCompressionState is one), with its own group

Every consumer gets an object with the same methods: start(tensors, params, last) -> Work,
start_from(source, buffer, params, last), end_step(), reserve(params, device), for_group(group);
saved_state() and load_state() carry its residuals in a checkpoint. Nothing outside this module tests
for a compression type (tests/test_layering.py checks it).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ._backend import backend_of, group_of
from ._spelling import deprecated_spelling
from .codes import CompressionSpec
from .compression import GradientCompression
from .gradients import mean_coalesced
from .options import WIRE_DTYPES, wire_dtype

__all__ = [
    "DdpMean",
    "KeepsMean",
    "WireMean",
    "compressed",
    "compression_settings",
    "deprecated_spelling",
    "load_state",
    "resolve",
    "saved_state",
]


class WireMean:
    """The mean over a group in one wire dtype (mean_coalesced: the group's strategy, with the cast and
    the 1/size fused into the packing pass). dtype None: the group's allreduce_grad_dtype, else the
    tensors' own; with `own_dtype` the tensors' own even where the group has an allreduce_grad_dtype."""

    def __init__(self, group, dtype: torch.dtype | None = None, *, own_dtype: bool = False):
        self.process_group = group
        self.dtype = dtype
        self.own_dtype = own_dtype

    def __repr__(self):
        return f"{type(self).__name__}(dtype={self.dtype})"

    def start(self, tensors, params=(), last: bool = True):
        """Start the mean of `tensors` in place; returns the Work (`params`, `last`: see GradientCompression)."""
        dtype = self.dtype if self.dtype is not None or not self.own_dtype else tensors[0].dtype
        return mean_coalesced(tensors, group=self.process_group, dtype=dtype, async_op=True)

    def end_step(self) -> None:
        """Nothing kept across steps."""

    def reserve(self, params, device) -> None:
        """Nothing to reserve: no residuals."""

    def for_group(self, group) -> "WireMean":
        """The same mean on another group of the same ranks."""
        return type(self)(group, self.dtype, own_dtype=self.own_dtype)

    def start_from(self, source: torch.Tensor, buffer: torch.Tensor, params=(), last: bool = True):
        """Start the mean of `source` in `buffer`, leaving `source` as it is."""
        buffer.copy_(source)
        return self.start([buffer], params, last)


class DdpMean(WireMean):
    """DDP's own mean, bit for bit: every gradient times 1/world size, then all_reduce'd (the reducer's
    order, and its arithmetic: torch's reducer multiplies by the reciprocal, which at 3 ranks gives other
    bits than a division; tests/test_overlap.py)."""

    def start(self, tensors, params=(), last: bool = True):
        scale = 1.0 / self.process_group.size()
        work = None
        for tensor in tensors:
            tensor.mul_(scale)
            # A chainermn group completes its ops in issue order: the last one's Work covers them all.
            work = dist.all_reduce(tensor, group=self.process_group, async_op=True)
        return work

    def start_from(self, source: torch.Tensor, buffer: torch.Tensor, params=(), last: bool = True):
        """The scaling writes the buffer: one pass over the gradients, not a copy and then a scaling."""
        torch.mul(source, 1.0 / self.process_group.size(), out=buffer)
        return dist.all_reduce(buffer, group=self.process_group, async_op=True)


def resolve(
    value,
    group,
    op: str,
    *,
    argument: str = "compression",
    plain=WireMean,
    own_dtype: bool = False,
    dtypes: bool = True,
):
    """(the mean `value` asks for, the group it runs on); see the module docstring.

    group: the caller's group (None: the default group), used unless `value` is a GradientCompression,
        which brings its own (a group given explicitly must then be that one).
    plain: what None means (WireMean, or DdpMean for DDP's bits); own_dtype: WireMean's.
    dtypes: whether a wire dtype is accepted (the overlap takes none).
    """
    if isinstance(value, GradientCompression):
        if group is not None and group_of(group, op) is not value.process_group:
            raise ValueError(f"{op}: {argument} works on another process group than process_group")
        return value, value.process_group
    group = group_of(group, op)
    backend_of(group, op)  # a chainermn group, or a clear error now
    if isinstance(value, dict):
        return GradientCompression(group, **_known_settings(value, op, argument), op=op), group
    if isinstance(value, CompressionSpec):
        return GradientCompression(group, compression=value, op=op), group
    if value is None:
        return plain(group, own_dtype=own_dtype), group
    if not dtypes:
        raise ValueError(
            f"{op}: {argument} must be None or a hooks.GradientCompressionState (or a dict of its "
            f"settings), got {value!r}"
        )
    if isinstance(value, torch.dtype) and value in WIRE_DTYPES.values():
        return WireMean(group, wire_dtype(value, f"{op}: {argument}")), group
    raise ValueError(
        f"{op}: {argument} must be None, torch.float16, torch.bfloat16 or a GradientCompression(State) "
        f"(also torch.float32, torch.float64, or a dict of its settings), got {value!r}"
    )


def _known_settings(value: dict, op: str, argument: str) -> dict:
    """A dict of GradientCompression's settings with the code under "code" (its old key "type" taken
    with a DeprecationWarning), or a ValueError naming an unknown setting."""
    value = dict(value)
    if "type" in value:
        value["code"], _ = deprecated_spelling(
            op, "code", "type", value.pop("code", None), value.pop("type"), key_of=argument, stacklevel=5
        )
    unknown = sorted(set(value) - set(GradientCompression.SETTINGS))
    if unknown:
        raise ValueError(
            f"{op}: {argument} has unknown settings {unknown} (known: {list(GradientCompression.SETTINGS)})"
        )
    return value


def compression_settings(value, op: str, *, argument: str = "compression", defaults: dict | None = None):
    """The settings a `compression=` value asks for, checked as GradientCompression checks them: a
    dict of every setting (GradientCompression.SETTINGS), or None for None (no code). For a caller that
    runs the codes itself on groups of its own (FSDP2's two hops), so a GradientCompression's group and
    residuals are not used, only its settings. defaults: settings under a dict's own (the caller's
    older arguments). A wire dtype is refused (such a caller has no plain mean in another dtype)."""
    if value is None:
        return None
    if isinstance(value, GradientCompression):
        return value.settings()
    if isinstance(value, CompressionSpec):
        return value.settings()
    if isinstance(value, dict):
        settings = {**GradientCompression.DEFAULTS, **(defaults or {}), **_known_settings(value, op, argument)}
        GradientCompression.check(op, **settings)
        return settings
    raise ValueError(
        f"{op}: {argument} must be None, a dict of GradientCompression's settings or a "
        f"GradientCompression(State), got {value!r}"
    )


class KeepsMean:
    """For a class that holds a resolved mean in `self.mean`: its compression, and that attribute's old
    name (the communicator's and the multi-node optimizer's `gradient_compression`)."""

    @property
    def compression(self) -> GradientCompression | None:
        """The GradientCompression the means go through, or None for a plain mean."""
        return compressed(self.mean)

    @property
    def gradient_compression(self) -> GradientCompression | None:
        """compression's old name."""
        warnings.warn(
            f"{type(self).__name__}.gradient_compression is deprecated, use .compression",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.compression


def compressed(mean) -> GradientCompression | None:
    """The GradientCompression a resolved mean keeps its residuals in, or None for a plain mean."""
    return mean if isinstance(mean, GradientCompression) else None


def saved_state(mean):
    """What a checkpoint keeps of a resolved mean: its compression's residuals (every rank's own,
    collective), or None."""
    return mean.state_dict(by_rank=True) if isinstance(mean, GradientCompression) else None


def load_state(mean, state, op: str) -> None:
    """Take saved_state()'s output back; a clear ValueError where it was saved with another kind of mean."""
    if isinstance(mean, GradientCompression) != (state is not None):
        raise ValueError(
            f"{op}: the state was saved {'with' if state is not None else 'without'} a "
            f"GradientCompression, this one sends {mean!r}"
        )
    if state is not None:
        mean.load_state_dict(state)
