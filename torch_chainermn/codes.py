"""Codes that carry float32 rows over a slow link: int8 and 4-bit blocks (ZeRO++), MXNet's 2-bit and 1-bit,
and top-k (SparseLoCo's outer gradients).

The torch operators `torch.ops.torch_chainermn.encode` / `decode` (CPU and CUDA; csrc/kernels/codes.h),
one pass over the values each, into and out of buffers the caller keeps (nothing allocated):

    wire = torch.empty(rows, wire_row_bytes("int8", count, block=256), dtype=torch.uint8)
    encode(values, wire, residual, code="int8", block=256)   # values, residual: [rows, count] float32
    decode(wire, out, code="int8", block=256, sum=True)      # out: [count], the sum of the rows

- "int8": one float32 scale (largest |value| / 127) per `block` values, round half to even. The
  residual (error feedback) is optional.
- "4bit": two values a byte, one float32 scale (largest |value| / 7) per `block` values (an even
  number), round half to even. The residual is optional.
- "2bit": +threshold, -threshold or 0 per value; "1bit": the sign, times the row's mean |value|.
  Both need a residual, which keeps what the codes did not carry (MXNet's rules, kernels/quantize.h).
- "topk": per `block` values (at most 65536), the `keep` of largest |value| (ties: the lower index),
  as a uint16 index and an int8 code each against one float32 scale (largest |value| / 127); decode
  gives zeros elsewhere. The residual is optional; with one, whatever was not sent waits in it.
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers the operators)

__all__ = ["CODES", "check_settings", "decode", "encode", "wire_row_bytes"]

CODES = ("int8", "2bit", "1bit", "4bit", "topk")  # kernels/codes.h's registry, in its order
BLOCK_CODES = ("int8", "4bit", "topk")  # one scale per `block` values
THRESHOLD_CODES = ("2bit",)
KEEP_CODES = ("topk",)  # send `keep` values of each block
TOPK_MAX_BLOCK = 1 << 16  # top-k's in-block indices are 16-bit


def check_settings(op: str, code: str, threshold: float = 0.5, block: int = 256, *, argument: str = "type",
                   keep: int = 8) -> None:
    """A ValueError naming `op` and the argument unless `code` is a code and the settings it reads are
    valid: the one validation of a code's settings in Python (the backend checks them again)."""
    if code not in CODES:
        raise ValueError(f"{op}: {argument} must be one of {CODES}, got {code!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < float("inf"):
        raise ValueError(f"{op}: threshold must be a finite number > 0, got {threshold!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{op}: block must be an int >= 1, got {block!r}")
    if code == "4bit" and block % 2:
        raise ValueError(f"{op}: block must be even for the 4bit code (two values a byte), got {block}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"{op}: keep must be an int >= 1, got {keep!r}")
    if code in KEEP_CODES:
        if block > TOPK_MAX_BLOCK:
            raise ValueError(f"{op}: block must be at most {TOPK_MAX_BLOCK} for the {code} code (16-bit indices), "
                             f"got {block}")
        if keep > block:
            raise ValueError(f"{op}: keep must be <= block ({block}) for the {code} code, got {keep}")


def wire_row_bytes(code: str, count: int, block: int = 256, keep: int = 8) -> int:
    """Bytes of one encoded row of `count` values (a multiple of 4); `keep`: top-k's values per block."""
    return torch.ops.torch_chainermn.wire_row_bytes(code, count, block, keep)


def encode(values: torch.Tensor, wire: torch.Tensor, residual: torch.Tensor | None = None, *, code: str,
           block: int = 256, threshold: float = 0.5, keep: int = 8) -> None:
    """Each row of `values` (+ `residual`) into its row of `wire` ([rows, wire_row_bytes] uint8, the
    device's current stream); the residual, when given, keeps what the codes did not carry."""
    torch.ops.torch_chainermn.encode(values, wire, residual, code, block, threshold, keep)


def decode(wire: torch.Tensor, out: torch.Tensor, *, code: str, block: int = 256, threshold: float = 0.5,
           sum: bool = False, keep: int = 8) -> None:  # noqa: A002  (the operator's name for it)
    """The rows of `wire` back into `out` ([rows, count] float32), or with sum=True their sum ([count])."""
    torch.ops.torch_chainermn.decode(wire, out, code, block, threshold, sum, keep)
