"""torch_chainermn.codes: the encode/decode operators (int8 and 4-bit blocks, 2-bit, 1-bit, top-k) against their
rules written plainly, bit for bit, and their errors. The CUDA versions: tests/test_cuda.py (same cases)."""

import struct

import pytest
import torch

from tests.support import compression_reference
from torch_chainermn import codes
from torch_chainermn.codes import CODES, CompressionSpec, check_settings, decode, encode, wire_row_bytes


def values(rows: int, count: int, seed: int, scale: float = 0.4) -> torch.Tensor:
    return torch.randn(rows, count, generator=torch.Generator().manual_seed(seed)) * scale


def block_rule(r: torch.Tensor, block: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes from -levels to levels, scales) of one row, block by block, as kernels/int8.h (127 levels)
    and kernels/int4.h (7) say."""
    codes = torch.zeros(r.numel(), dtype=torch.int32)
    scales = []
    for start in range(0, r.numel(), block):
        piece = r[start : start + block]
        largest = piece.abs().max()
        scales.append(largest / levels)
        if largest > 0:
            inverse = (
                torch.tensor(float(levels)) / largest
            )  # a true division (levels / largest: a reciprocal times levels)
            codes[start : start + block] = torch.round(piece * inverse).clamp(-levels, levels).to(torch.int32)
    return codes, torch.stack(scales) if scales else torch.zeros(0)


BLOCK_CODES = {"int8": (127, 8), "4bit": (7, 4), "int2": (1, 2)}  # levels a side, bits a value


def block_code_row(code: str, r: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the wire row, the values it carries) of a block code (kernels/int8.h, int4.h, int2.h): the
    codes in two's complement, 8 // bits a byte (value i at bits bits * (i % per_byte) of byte
    i // per_byte), zero bytes to a multiple of 4, then one float32 scale a block."""
    levels, bits = BLOCK_CODES[code]
    per_byte = 8 // bits
    codes, scales = block_rule(r, block, levels)
    row = torch.zeros(wire_row_bytes(code, r.numel(), block), dtype=torch.uint8)
    fields = torch.zeros(-(-r.numel() // per_byte) * per_byte, dtype=torch.int32)
    fields[: r.numel()] = codes & ((1 << bits) - 1)
    packed = (fields.view(-1, per_byte) << (torch.arange(per_byte, dtype=torch.int32) * bits)).sum(dim=1)
    row[: packed.numel()] = packed.to(torch.uint8)
    offset = -(-packed.numel() // 4) * 4
    row[offset:] = scales.view(torch.uint8)
    carried = codes.float() * scales.repeat_interleave(block)[: r.numel()] if r.numel() else r.clone()
    return row, carried


def sent_by_rule(code: str, r: torch.Tensor, block: int, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the wire row, the values it carries) of one row r (residual + values), by the plain rules."""
    if code in BLOCK_CODES:
        return block_code_row(code, r, block)
    words, _, carried = compression_reference.quantize(code, r, None, r.numel(), threshold)
    return words.view(torch.uint8), carried


def rule_of(code: str):
    """The plain rule of a registered code: (r, block, threshold, keep) -> (its wire row, the values it
    carries). A code registered without one fails here (test_every_registered_code_has_its_tests)."""
    if code == "topk":
        return lambda r, block, threshold, keep: topk_rule(r, block, keep)
    if code in (*BLOCK_CODES, "2bit", "1bit"):
        return lambda r, block, threshold, keep: sent_by_rule(code, r, block, threshold)
    raise KeyError(f"tests/test_codes.py has no rule for the {code!r} code: write one (rule_of)")


def test_every_registered_code_has_its_tests():
    """Every code of the backend's registry has its plain rule here and its reference in
    tests/support/compression_reference.py (the mean's), and no rule stands for a code that is not
    registered: the tests below run over the registry, so a code's tests come with it."""
    for code in CODES:
        rule_of(code)
    assert set(compression_reference.WRITTEN) == set(CODES)


def test_python_reads_the_registry():
    """torch_chainermn.codes names no code: its lists come from the backend's registry."""
    registered = [code["name"] for code in torch_chainermn_C().codes.registered()]
    assert CODES == tuple(registered) and len(CODES) >= 5
    assert set(codes.SUMS_CODES) == {c for c in CODES if codes.describe(c)["carries_sums"]}
    for code in CODES:
        described = codes.describe(code)
        assert set(described["reads"]) <= {"threshold", "block", "keep"}
        assert described["summary"], code


def torch_chainermn_C():
    from torch_chainermn import _C

    return _C


# A code that needs a residual always carries one; the others with one (gradients) and without (weights).
FEEDBACK = [
    (code, feedback)
    for code in CODES
    for feedback in (True, False)
    if feedback or not codes.describe(code)["needs_residual"]
]


@pytest.mark.parametrize("code, feedback", FEEDBACK)
@pytest.mark.parametrize("rows, count, block", [(1, 1, 4), (3, 1000, 256), (2, 37, 5), (2, 4099, 64), (1, 0, 8)])
def test_codes_equal_the_rules_bit_for_bit(code, feedback, rows, count, block):
    threshold = 0.3
    multiple = codes.describe(code)["block_multiple"]
    block += -block % multiple  # 4-bit blocks are even (a block starts on a byte)
    spec = CompressionSpec(code, block=block, threshold=threshold, keep=min(3, block))
    x, residual = values(rows, count, 1), values(rows, count, 2, scale=0.1)
    wire = torch.full((rows, wire_row_bytes(spec, count)), 0xAB, dtype=torch.uint8)
    kept = residual.clone() if feedback else None
    encode(x, wire, kept, spec)
    carried = []
    for row in range(rows):
        r = residual[row] + x[row] if feedback else x[row]
        expected_row, row_carried = rule_of(code)(r, block, threshold, spec.keep)
        assert torch.equal(wire[row], expected_row), f"row {row}"
        if feedback:
            assert torch.equal(kept[row], r - row_carried), f"row {row}: the residual"
        carried.append(row_carried)
    out = torch.full((rows, count), 7.0)
    decode(wire, out, spec)
    assert torch.equal(out, torch.stack(carried))
    total = torch.full((count,), 7.0)
    decode(wire, total, spec, sum=True)
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
        f"code must be one of {', '.join(map(repr, CODES))}, got 'int4'": lambda: encode(x, wire, code="int4", block=4),
        "block must be >= 1, got 0": lambda: encode(x, wire, code="int8", block=0),
        # (a wire of any size: the settings are checked first, and wire_row_bytes refuses an odd 4-bit block too)
        "block must be a multiple of 2 for the 4bit code, got 3": lambda: encode(
            x, torch.empty(2, 24, dtype=torch.uint8), code="4bit", block=3
        ),
        "torch_chainermn.encode: wire must be [2, 32]": lambda: encode(x, wire, code="int8", block=2),
        "values must be float32, got Double": lambda: encode(x.double(), wire, code="int8", block=4),
        "the 2bit code needs a residual": lambda: encode(
            x, torch.empty(2, wire_row_bytes("2bit", 10), dtype=torch.uint8), code="2bit"
        ),
        "residual must have the values' shape": lambda: encode(x, wire, torch.zeros(2, 9), code="int8", block=4),
        "torch_chainermn.decode: out must be 1-D [values] (sum=True)": lambda: decode(
            wire, torch.empty(2, 10), code="int8", block=4, sum=True
        ),
        "torch_chainermn.decode: wire rows of 24 bytes do not hold 13 values": lambda: decode(
            wire, torch.empty(2, 13), code="int8", block=4
        ),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match="torch_chainermn") as raised:
            call()
        assert message in str(raised.value)


# ---- the operators take the spec whole -----------------------------------------------------------

SPEC_TYPE = "__torch__.torch.classes.torch_chainermn.CompressionSpec"


def test_the_operators_take_one_spec():
    """Each operator's schema has one `spec` of torch's custom class and no setting of its own."""
    ops = torch.ops.torch_chainermn
    schemas = {name: str(getattr(ops, name).default._schema) for name in ("encode", "decode", "wire_row_bytes")}
    for name, schema in schemas.items():
        assert f"{SPEC_TYPE} spec" in schema, schema
        assert not any(f" {setting}" in schema for setting in ("code,", "block", "threshold", "keep")), schema
    assert "bool sum=False" in schemas["decode"]


@pytest.mark.parametrize("code", CODES)
def test_the_operators_called_with_a_spec_give_the_rules_bytes(code):
    """torch.ops.torch_chainermn.* called directly with a CompressionSpec, for every registered code: the
    wire, residual and decoded rows are the rules' (the bytes the settings-by-position operators gave)."""
    rows, count, threshold = 2, 300, 0.3
    block = 64 + -64 % codes.describe(code)["block_multiple"]
    spec = CompressionSpec(code, block=block, threshold=threshold, keep=3)
    x, residual = values(rows, count, 5), values(rows, count, 6, scale=0.1)
    row_bytes = torch.ops.torch_chainermn.wire_row_bytes(spec, count)
    assert row_bytes == wire_row_bytes(spec, count) == wire_row_bytes(code, count, block, keep=3)
    wire, kept = torch.full((rows, row_bytes), 0xAB, dtype=torch.uint8), residual.clone()
    torch.ops.torch_chainermn.encode(x, wire, kept, spec)
    out, total = torch.full((rows, count), 7.0), torch.full((count,), 7.0)
    torch.ops.torch_chainermn.decode(wire, out, spec)
    torch.ops.torch_chainermn.decode(wire, total, spec, True)
    for row in range(rows):
        r = residual[row] + x[row]
        expected_row, carried = rule_of(code)(r, block, threshold, 3)
        assert torch.equal(wire[row], expected_row), f"row {row}"
        assert torch.equal(kept[row], r - carried), f"row {row}: the residual"
        assert torch.equal(out[row], carried), f"row {row}: decoded"
    assert torch.equal(total, out[0] + out[1])


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # TorchScript, to save the spec
def test_a_spec_is_torchs_custom_class_and_a_value():
    """The one Python class is a torch.ScriptObject of the operators' custom class, and a value: equal
    specs hash alike, it pickles, a copy is itself, its fields are not set, TorchScript saves it."""
    import copy
    import io
    import pickle

    spec = CompressionSpec("4bit", block=64, compress_result="int8")
    assert isinstance(spec, torch.ScriptObject) and isinstance(spec, CompressionSpec)
    assert spec._type().qualified_name() == SPEC_TYPE
    same = CompressionSpec("4bit", block=64, compress_result="int8")
    assert spec == same and hash(spec) == hash(same) and spec != CompressionSpec("4bit", block=32) and spec != "4bit"
    assert str(spec) == repr(spec) and repr(spec).startswith("CompressionSpec('4bit', ")
    back = pickle.loads(pickle.dumps(spec))
    assert type(back) is CompressionSpec and back == spec and back.settings() == spec.settings()
    assert copy.copy(spec) is spec and copy.deepcopy(spec) is spec
    # torch.ScriptObject's operators (forwarded to TorchScript methods the class lacks) are not its own
    assert bool(spec) and not (spec != same)
    for operation in (len, lambda s: s < same, lambda s: s + 1, lambda s: 1 in s):
        with pytest.raises(TypeError):
            operation(spec)
    with pytest.raises(AttributeError, match="CompressionSpec is a value: its block cannot be set"):
        spec.block = 32
    assert spec.block == 64

    class Encoder(torch.nn.Module):
        def __init__(self, spec):
            super().__init__()
            self.spec = spec

        def forward(self, x: torch.Tensor, wire: torch.Tensor) -> torch.Tensor:
            torch.ops.torch_chainermn.encode(x, wire, None, self.spec)
            return wire

    saved = io.BytesIO()
    int8 = CompressionSpec("int8", block=16)
    torch.jit.save(torch.jit.script(Encoder(int8)), saved)  # the custom class's state (def_pickle)
    saved.seek(0)
    x = values(2, 50, 7)
    loaded, plain = (torch.zeros(2, wire_row_bytes(int8, 50), dtype=torch.uint8) for _ in range(2))
    torch.jit.load(saved)(x, loaded)
    encode(x, plain, None, int8)
    assert torch.equal(loaded, plain)


def test_an_operator_given_no_spec_names_itself():
    x = values(2, 10, 1)
    wire = torch.empty(2, wire_row_bytes("int8", 10, 4), dtype=torch.uint8)
    raw = {
        "torch_chainermn::encode": lambda: torch.ops.torch_chainermn.encode(x, wire, None, "int8"),
        "torch_chainermn::decode": lambda: torch.ops.torch_chainermn.decode(wire, torch.empty(2, 10), {"code": "int8"}),
        "torch_chainermn::wire_row_bytes": lambda: torch.ops.torch_chainermn.wire_row_bytes(None, 10),
    }
    for op, call in raw.items():
        with pytest.raises(RuntimeError) as raised:
            call()
        assert op in str(raised.value) and f"{SPEC_TYPE}" in str(raised.value) and "'spec'" in str(raised.value)
    wrapped = {
        "torch_chainermn.encode: the code must be a CompressionSpec or a code's name, got 3": lambda: encode(
            x, wire, None, 3
        ),
        "torch_chainermn.decode: the settings come with the CompressionSpec, got ['block'] too": lambda: decode(
            wire, torch.empty(2, 10), CompressionSpec("int8", block=4), block=4
        ),
        "torch_chainermn.wire_row_bytes: count must be >= 0, got -1": lambda: wire_row_bytes(
            CompressionSpec("int8"), -1
        ),
    }
    for message, call in wrapped.items():
        with pytest.raises(ValueError) as raised:
            call()
        assert message in str(raised.value)


# ---- top-k --------------------------------------------------------------------------------------


def topk_rule(r: torch.Tensor, block: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the wire row, the values it carries) of one row r by kernels/topk.h's rule: per block, a float32
    scale (largest |r| / 127), the `keep` chosen indices as uint16 and their int8 codes (a short block's
    unused slots: 0xFFFF and 0), zero bytes to a multiple of 4."""
    row, carried = b"", torch.zeros_like(r)
    for start in range(0, r.numel(), block):
        piece = r[start : start + block]
        chosen = compression_reference.topk_chosen(piece, keep)
        largest = piece.abs().max()
        scale = largest / 127
        codes = torch.zeros(chosen.numel(), dtype=torch.int32)
        if largest > 0:
            inverse = torch.tensor(127.0) / largest
            codes = torch.round(piece[chosen] * inverse).clamp(-127, 127).to(torch.int32)
        carried[start + chosen] = codes.float() * scale
        unused = keep - chosen.numel()
        blob = (
            struct.pack("<f", float(scale))
            + struct.pack(f"<{keep}H", *chosen.tolist(), *[0xFFFF] * unused)
            + struct.pack(f"<{keep}b", *codes.tolist(), *[0] * unused)
        )
        row += blob + bytes(-len(blob) % 4)
    return torch.tensor(list(row), dtype=torch.uint8), carried


def topk_values(rows: int, count: int, seed: int, ties: bool) -> torch.Tensor:
    """Gaussian values, or (ties) a few magnitudes only, zeros and -0 among them."""
    if not ties:
        return values(rows, count, seed)
    x = torch.randint(-3, 4, (rows, count), generator=torch.Generator().manual_seed(seed)).float() * 0.25
    x[x == 0] = -0.0
    return x


# Short last blocks (some shorter than keep), keep 1 and keep = block, a few of many (the CPU's stack
# heap) and many of a block (its nth_element), blocks of 4096.
@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(
    "rows, count, block, keep",
    [
        (1, 1, 4, 1),
        (1, 1, 4, 4),
        (3, 1000, 256, 8),
        (2, 37, 5, 2),
        (2, 37, 16, 7),
        (2, 4099, 64, 1),
        (2, 4099, 64, 64),
        (2, 1100, 512, 100),
        (1, 5000, 4096, 8),
        (1, 0, 8, 3),
    ],
)
def test_topk_equals_its_rule_bit_for_bit(rows, count, block, keep, ties, feedback):
    x, residual = topk_values(rows, count, 1, ties), topk_values(rows, count, 2, ties) * 0.5
    wire = torch.full((rows, wire_row_bytes("topk", count, block, keep)), 0xAB, dtype=torch.uint8)
    kept = residual.clone() if feedback else None
    encode(x, wire, kept, code="topk", block=block, keep=keep)
    carried = []
    for row in range(rows):
        r = residual[row] + x[row] if feedback else x[row]
        expected_row, row_carried = topk_rule(r, block, keep)
        assert torch.equal(wire[row], expected_row), f"row {row}"
        if feedback:  # what was not carried: all of r where nothing was sent
            assert torch.equal(kept[row].view(torch.int32), (r - row_carried).view(torch.int32)), f"row {row}"
        carried.append(row_carried)
    out = torch.full((rows, count), 7.0)
    decode(wire, out, code="topk", block=block, keep=keep)
    assert torch.equal(out, torch.stack(carried))
    total = torch.full((count,), 7.0)
    decode(wire, total, code="topk", block=block, keep=keep, sum=True)
    expected_total = carried[0].clone()
    for row_carried in carried[1:]:
        expected_total += row_carried
    assert torch.equal(total, expected_total)
    if count:
        sent = (out != 0).view(rows, -1).sum(dim=1)
        assert (sent <= keep * -(-count // block)).all()


def test_topk_row_layout():
    """Block 0 of 5: the two largest |value|, the tie at 3 to the lower index; block 1 is one value,
    shorter than keep: its second slot unused. 12 bytes a block (4 + 2 x 2 + 2, two zero bytes)."""
    x = torch.tensor([[0.0, 3.0, -3.0, 3.0, 0.5, -4.0]])
    wire = torch.full((1, wire_row_bytes("topk", 6, 5, keep=2)), 0xAB, dtype=torch.uint8)
    assert wire.shape[1] == 2 * 12
    kept = torch.zeros(1, 6)
    encode(x, wire, kept, code="topk", block=5, keep=2)
    row = bytes(wire[0].tolist())
    scales = (torch.tensor(3.0) / 127, torch.tensor(4.0) / 127)
    assert struct.unpack("<f2H2b2x", row[:12]) == (float(scales[0]), 1, 2, 127, -127)
    assert struct.unpack("<f2H2b2x", row[12:]) == (float(scales[1]), 0, 0xFFFF, -127, 0)
    assert row[10:12] == row[22:24] == b"\0\0"
    out = torch.empty(1, 6)
    decode(wire, out, code="topk", block=5, keep=2)
    s0, s1 = scales[0] * 127, scales[1] * 127
    assert out[0].tolist() == [0.0, float(s0), float(-s0), 0.0, 0.0, float(-s1)]
    assert torch.equal(kept, x - out)  # index 3's 3.0 and 4's 0.5 wait in the residual


def test_topk_rows_have_one_size_whatever_the_values():
    """Every rank of a mean sends the same bytes: a row's size is count, block and keep's alone, and any
    values (zeros, one spike, noise) fill all of it."""
    count, block, keep = 1001, 64, 5
    assert wire_row_bytes("topk", count, block, keep) == 16 * 20  # 16 blocks of 4 + 3 x 5 bytes, to 20
    spike = torch.zeros(1, count)
    spike[0, 500] = 9.0
    for x in (torch.zeros(1, count), spike, values(1, count, 3)):
        wire = torch.full((1, 16 * 20), 0xAB, dtype=torch.uint8)
        encode(x, wire, code="topk", block=block, keep=keep)
        assert torch.equal(wire[0], topk_rule(x[0], block, keep)[0])


def test_topk_errors_name_the_op_and_the_argument():
    x = values(2, 10, 1)
    wire = torch.empty(2, wire_row_bytes("topk", 10, 4, keep=2), dtype=torch.uint8)
    cases = {
        "torch_chainermn.encode: keep must be >= 1 and <= block (4) for the topk code, got 0": lambda: encode(
            x, wire, code="topk", block=4, keep=0
        ),
        "torch_chainermn.encode: keep must be >= 1 and <= block (4) for the topk code, got 5": lambda: encode(
            x, wire, code="topk", block=4, keep=5
        ),
        "torch_chainermn.encode: block must be at most 65536 for the topk code, got 65537": lambda: encode(
            x, wire, code="topk", block=65537, keep=2
        ),
        "torch_chainermn.encode: wire must be [2, 48]": lambda: encode(x, wire, code="topk", block=4, keep=3),
        "torch_chainermn.decode: keep must be >= 1 and <= block (4) for the topk code, got 9": lambda: decode(
            wire, torch.empty(2, 10), code="topk", block=4, keep=9
        ),
        "torch_chainermn.decode: wire rows of 36 bytes do not hold 10 values (48 bytes)": lambda: decode(
            wire, torch.empty(2, 10), code="topk", block=4, keep=3
        ),
        "torch_chainermn.wire_row_bytes: keep must be >= 1 and <= block (4) for the topk code, got 5": lambda: (
            wire_row_bytes("topk", 10, 4, keep=5)
        ),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match="torch_chainermn") as raised:
            call()
        assert message in str(raised.value)
    python_cases = {
        "DiLoCo: keep must be >= 1 and <= block (64) for the topk code, got 0": dict(keep=0),
        "DiLoCo: keep must be an int, got True": dict(keep=True),
        "DiLoCo: keep must be >= 1 and <= block (64) for the topk code, got 65": dict(keep=65),
        "DiLoCo: block must be at most 65536 for the topk code, got 70000": dict(block=70000),
    }
    for message, settings in python_cases.items():
        with pytest.raises(ValueError) as raised:
            check_settings("DiLoCo", "topk", **{"block": 64, **settings})
        assert message in str(raised.value)
    check_settings("DiLoCo", "int8", block=4)  # keep (8 by default) is top-k's alone: larger than int8's block
