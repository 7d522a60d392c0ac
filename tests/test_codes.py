"""torch_chainermn.codes: the encode/decode operators (int8 and 4-bit blocks, 2-bit, 1-bit) against their rules
written plainly, bit for bit, and their errors. The CUDA versions: tests/test_cuda.py (same cases)."""
import pytest
import torch

from tests.support import compression_reference
from torch_chainermn.codes import decode, encode, wire_row_bytes


def values(rows: int, count: int, seed: int, scale: float = 0.4) -> torch.Tensor:
    return torch.randn(rows, count, generator=torch.Generator().manual_seed(seed)) * scale


def block_rule(r: torch.Tensor, block: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes from -levels to levels, scales) of one row, block by block, as kernels/int8.h (127 levels)
    and kernels/int4.h (7) say."""
    codes = torch.zeros(r.numel(), dtype=torch.int32)
    scales = []
    for start in range(0, r.numel(), block):
        piece = r[start:start + block]
        largest = piece.abs().max()
        scales.append(largest / levels)
        if largest > 0:
            inverse = torch.tensor(float(levels)) / largest  # a true division (levels / largest: a reciprocal times levels)
            codes[start:start + block] = torch.round(piece * inverse).clamp(-levels, levels).to(torch.int32)
    return codes, torch.stack(scales) if scales else torch.zeros(0)


def sent_by_rule(code: str, r: torch.Tensor, block: int, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the wire row, the values it carries) of one row r (residual + values), by the plain rules."""
    if code == "4bit":
        codes, scales = block_rule(r, block, 7)
        row = torch.zeros(wire_row_bytes("4bit", r.numel(), block), dtype=torch.uint8)
        nibbles = (codes & 0xF).to(torch.uint8)  # two's complement in 4 bits
        for i in range(r.numel()):  # value i: the low nibble of byte i // 2 when even, the high when odd
            row[i // 2] |= int(nibbles[i]) << (4 * (i % 2))
        offset = -(-((r.numel() + 1) // 2) // 4) * 4
        row[offset:] = scales.view(torch.uint8)
        carried = codes.float() * scales.repeat_interleave(block)[:r.numel()] if r.numel() else r.clone()
        return row, carried
    if code == "int8":
        codes, scales = block_rule(r, block, 127)
        row = torch.zeros(wire_row_bytes("int8", r.numel(), block), dtype=torch.uint8)
        row[:r.numel()] = codes.to(torch.int8).view(torch.uint8)
        offset = -(-r.numel() // 4) * 4
        row[offset:] = scales.view(torch.uint8)
        carried = codes.float() * scales.repeat_interleave(block)[:r.numel()] if r.numel() else r.clone()
        return row, carried
    words, _, carried = compression_reference.quantize(code, r, None, r.numel(), threshold)
    return words.view(torch.uint8), carried


# 2bit and 1bit always carry a residual; int8 and 4bit with one (gradients) and without (weights).
@pytest.mark.parametrize("code, feedback", [("int8", True), ("int8", False), ("4bit", True), ("4bit", False),
                                            ("2bit", True), ("1bit", True)])
@pytest.mark.parametrize("rows, count, block", [(1, 1, 4), (3, 1000, 256), (2, 37, 5), (2, 4099, 64), (1, 0, 8)])
def test_codes_equal_the_rules_bit_for_bit(code, feedback, rows, count, block):
    threshold = 0.3
    block += block % 2 if code == "4bit" else 0  # 4-bit blocks are even (a block starts on a byte)
    x, residual = values(rows, count, 1), values(rows, count, 2, scale=0.1)
    wire = torch.full((rows, wire_row_bytes(code, count, block)), 0xAB, dtype=torch.uint8)
    kept = residual.clone() if feedback else None
    encode(x, wire, kept, code=code, block=block, threshold=threshold)
    carried = []
    for row in range(rows):
        r = residual[row] + x[row] if feedback else x[row]
        expected_row, row_carried = sent_by_rule(code, r, block, threshold)
        assert torch.equal(wire[row], expected_row), f"row {row}"
        if feedback:
            assert torch.equal(kept[row], r - row_carried), f"row {row}: the residual"
        carried.append(row_carried)
    out = torch.full((rows, count), 7.0)
    decode(wire, out, code=code, block=block, threshold=threshold)
    assert torch.equal(out, torch.stack(carried))
    total = torch.full((count,), 7.0)
    decode(wire, total, code=code, block=block, threshold=threshold, sum=True)
    expected_total = carried[0].clone()
    for row_carried in carried[1:]:
        expected_total += row_carried
    assert torch.equal(total, expected_total)


def test_int8_row_layout_and_an_all_zero_block():
    x = torch.tensor([[0.0, 0.0, 0.0, 1.0, -2.0, 127.0]])
    wire = torch.full((1, wire_row_bytes("int8", 6, 3)), 0xAB, dtype=torch.uint8)
    assert wire.shape[1] == 8 + 2 * 4  # 6 codes, 2 zero bytes, 2 scales
    encode(x, wire, code="int8", block=3)
    assert wire[0, :8].view(torch.int8).tolist() == [0, 0, 0, 1, -2, 127, 0, 0]
    assert wire[0, 8:].view(torch.float32).tolist() == [0.0, 1.0]


def test_errors_name_the_op_and_the_argument():
    x, wire = values(2, 10, 1), torch.empty(2, wire_row_bytes("int8", 10, 4), dtype=torch.uint8)
    cases = {
        "code must be one of 'int8', '2bit', '1bit', '4bit', got 'int4'": lambda: encode(x, wire, code="int4", block=4),
        "block must be >= 1, got 0": lambda: encode(x, wire, code="int8", block=0),
        "block must be even for the 4bit code, got 3": lambda: encode(
            x, torch.empty(2, wire_row_bytes("4bit", 10, 3), dtype=torch.uint8), code="4bit", block=3),
        "torch_chainermn.encode: wire must be [2, 32]": lambda: encode(x, wire, code="int8", block=2),
        "values must be float32, got Double": lambda: encode(x.double(), wire, code="int8", block=4),
        "the 2bit code needs a residual": lambda: encode(
            x, torch.empty(2, wire_row_bytes("2bit", 10), dtype=torch.uint8), code="2bit"),
        "residual must have the values' shape": lambda: encode(x, wire, torch.zeros(2, 9), code="int8", block=4),
        "torch_chainermn.decode: out must be 1-D [values] (sum=True)": lambda: decode(
            wire, torch.empty(2, 10), code="int8", block=4, sum=True),
        "torch_chainermn.decode: wire rows of 24 bytes do not hold 13 values": lambda: decode(
            wire, torch.empty(2, 13), code="int8", block=4),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match="torch_chainermn") as raised:
            call()
        assert message in str(raised.value)
