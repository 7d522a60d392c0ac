"""Codes that carry float32 rows over a slow link: int8 blocks (ZeRO++), MXNet's 2-bit and 1-bit.

The torch operators `torch.ops.torch_chainermn.encode` / `decode` (CPU and CUDA; csrc/kernels/codes.h),
one pass over the values each, into and out of buffers the caller keeps (nothing allocated):

    wire = torch.empty(rows, wire_row_bytes("int8", count, block=256), dtype=torch.uint8)
    encode(values, wire, residual, code="int8", block=256)   # values, residual: [rows, count] float32
    decode(wire, out, code="int8", block=256, sum=True)      # out: [count], the sum of the rows

- "int8": one float32 scale (largest |value| / 127) per `block` values, round half to even. The
  residual (error feedback) is optional.
- "2bit": +threshold, -threshold or 0 per value; "1bit": the sign, times the row's mean |value|.
  Both need a residual, which keeps what the codes did not carry (MXNet's rules, kernels/quantize.h).
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers the operators)

__all__ = ["CODES", "decode", "encode", "wire_row_bytes"]

CODES = ("int8", "2bit", "1bit")


def wire_row_bytes(code: str, count: int, block: int = 256) -> int:
    """Bytes of one encoded row of `count` values (a multiple of 4)."""
    return torch.ops.torch_chainermn.wire_row_bytes(code, count, block)


def encode(values: torch.Tensor, wire: torch.Tensor, residual: torch.Tensor | None = None, *, code: str,
           block: int = 256, threshold: float = 0.5) -> None:
    """Each row of `values` (+ `residual`) into its row of `wire` ([rows, wire_row_bytes] uint8, the
    device's current stream); the residual, when given, keeps what the codes did not carry."""
    torch.ops.torch_chainermn.encode(values, wire, residual, code, block, threshold)


def decode(wire: torch.Tensor, out: torch.Tensor, *, code: str, block: int = 256, threshold: float = 0.5,
           sum: bool = False) -> None:  # noqa: A002  (the operator's name for it)
    """The rows of `wire` back into `out` ([rows, count] float32), or with sum=True their sum ([count])."""
    torch.ops.torch_chainermn.decode(wire, out, code, block, threshold, sum)
