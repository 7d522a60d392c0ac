"""Block-quantised int8 (ZeRO++'s qwZ/qgZ code): one float32 scale per `block` values.

A block's scale is its largest magnitude / 127; a value travels as round(value / scale), clamped
to [-127, 127], and comes back as code x scale. Written with torch ops on views of buffers the
caller keeps (no allocation beyond torch's temporaries); the one-pass kernels beside the 2-bit
ones (csrc/kernels/quantize) are the next step.
"""
from __future__ import annotations

import torch

LEVELS = 127.0


def padded(count: int, block: int) -> int:
    """Values a chunk of `count` takes once padded to whole blocks."""
    return -(-count // block) * block


def quantize_(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, sent: torch.Tensor | None = None) -> None:
    """Quantise `values` ([chunks, padded values], float32) into `codes` (int8, same shape) and
    `scales` ([chunks, blocks], float32); with `sent`, also write what the codes carry (the
    dequantised values, for error feedback)."""
    chunks, width = values.shape
    per_block = width // scales.shape[1]
    blocks = values.view(chunks, -1, per_block)
    torch.amax(blocks.abs(), dim=2, out=scales)
    scales.div_(LEVELS)
    safe = scales.masked_fill(scales == 0, 1.0).unsqueeze(2)  # an all-zero block: codes 0
    quantized = torch.round(blocks / safe).clamp_(-LEVELS, LEVELS)
    codes.view(chunks, -1, per_block).copy_(quantized)
    if sent is not None:
        torch.mul(quantized, scales.unsqueeze(2), out=sent.view(chunks, -1, per_block))


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes x scales, float32, [chunks, padded values]."""
    chunks, width = codes.shape
    return (codes.view(chunks, scales.shape[1], -1).to(torch.float32) * scales.unsqueeze(2)).view(chunks, width)


def dequantize_sum(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """out = sum over the chunks of codes x scales ([chunks, padded] int8, [chunks, blocks]) for the
    first out.numel() values."""
    torch.sum(dequantize(codes, scales)[:, :out.numel()], dim=0, out=out)
