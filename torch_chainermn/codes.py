"""Codes that carry float32 rows over a slow link: int8 and 4-bit blocks (ZeRO++), MXNet's 2-bit and 1-bit,
and top-k (SparseLoCo's outer gradients); every code the backend registers (csrc/kernels/codes.h).

Every list of codes and every rule on their settings here is read from the backend's registry
(torch_chainermn._C.codes): a code describes itself once, in its own C++ files, and nothing in
Python names one. `describe(code)` says what a code reads and its rules; `CompressionSpec` is a code
with its settings, the one value every `compression=` takes.

The torch operators `torch.ops.torch_chainermn.encode` / `decode` (CPU and CUDA), one pass over the
values each, into and out of buffers the caller keeps (nothing allocated):

    spec = CompressionSpec("int8", block=256)
    wire = torch.empty(rows, wire_row_bytes(spec, count), dtype=torch.uint8)
    encode(values, wire, residual, spec)   # values, residual: [rows, count] float32
    decode(wire, out, spec, sum=True)      # out: [count], the sum of the rows

(The code's name with its settings as keywords, `encode(values, wire, residual, code="int8", block=256)`,
is the same call.)
"""

from __future__ import annotations

import functools

import torch

from . import _C  # noqa: F401  (registers the operators and _C.codes)

__all__ = ["CODES", "CompressionSpec", "check_settings", "decode", "describe", "encode", "wire_row_bytes"]

CompressionSpec = _C.codes.CompressionSpec

_REGISTERED = {code["name"]: code for code in _C.codes.registered()}
CODES = tuple(_REGISTERED)  # every registered code, by name
SUMS_CODES = tuple(name for name, code in _REGISTERED.items() if code["carries_sums"])  # compress_result="<name>"


def describe(code: str) -> dict:
    """What the backend's registry says of `code`: its summary, the settings it reads ("threshold",
    "block", "keep") and their rules (block_multiple, max_block), needs_residual, carries_sums,
    has_cuda."""
    if code not in _REGISTERED:
        raise ValueError(f"torch_chainermn.codes.describe: code must be one of {CODES}, got {code!r}")
    return dict(_REGISTERED[code])


def check_settings(
    op: str, code: str, threshold: float = 0.5, block: int = 256, *, argument: str = "code", keep: int = 8
) -> None:
    """A ValueError naming `op` and the argument unless `code` is a registered code and the settings
    it reads follow its rules: the backend's one check (kernels/codes.h's checkCodeSettings)."""
    if not isinstance(code, str):
        raise ValueError(f"{op}: {argument} must be one of {CODES}, got {code!r}")
    _C.codes.check_settings(op, code, threshold, block, keep, argument)


def _spec_of(spec, settings: dict, op: str) -> CompressionSpec:
    """A CompressionSpec from one (unchanged), or from a code's name and its settings as keywords."""
    if isinstance(spec, CompressionSpec):
        if settings:
            raise ValueError(f"{op}: the settings come with the CompressionSpec, got {sorted(settings)} too")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"{op}: the code must be a CompressionSpec or a code's name, got {spec!r}")
    try:
        return _spec_named(spec, tuple(sorted(settings.items())), op)
    except TypeError:  # a setting Python cannot hash: checked (and refused) uncached
        return CompressionSpec(spec, op=op, **settings)


@functools.lru_cache(maxsize=64)
def _spec_named(code: str, settings: tuple, op: str) -> CompressionSpec:
    """A code's name and settings as a CompressionSpec, made once: a caller that passes names to
    every call (a benchmark's loop) pays for the check once."""
    return CompressionSpec(code, op=op, **dict(settings))


def wire_row_bytes(spec: CompressionSpec | str, count: int, block: int | None = None, keep: int | None = None) -> int:
    """Bytes of one encoded row of `count` values (a multiple of 4), for a CompressionSpec or a code's
    name with its settings."""
    settings = {name: value for name, value in (("block", block), ("keep", keep)) if value is not None}
    spec = _spec_of(spec, settings, "torch_chainermn.wire_row_bytes")
    return torch.ops.torch_chainermn.wire_row_bytes(spec, count)


def encode(
    values: torch.Tensor,
    wire: torch.Tensor,
    residual: torch.Tensor | None = None,
    spec: CompressionSpec | None = None,
    *,
    code: str | None = None,
    **settings,
) -> None:
    """Each row of `values` (+ `residual`) into its row of `wire` ([rows, wire_row_bytes] uint8, the
    device's current stream), as `spec` (or `code=` with its settings) says; the residual, when
    given, keeps what the codes did not carry."""
    spec = _spec_of(spec if spec is not None else code, settings, "torch_chainermn.encode")
    torch.ops.torch_chainermn.encode(values, wire, residual, spec)


def decode(
    wire: torch.Tensor,
    out: torch.Tensor,
    spec: CompressionSpec | None = None,
    *,
    code: str | None = None,
    sum: bool = False,
    **settings,
) -> None:  # noqa: A002  (the operator's name for it)
    """The rows of `wire` back into `out` ([rows, count] float32), or with sum=True their sum ([count])."""
    spec = _spec_of(spec if spec is not None else code, settings, "torch_chainermn.decode")
    torch.ops.torch_chainermn.decode(wire, out, spec, sum)
