"""Gradient compression written plainly in PyTorch, value by value, as kernels/codes.h (int8.h, int4.h,
quantize.h, topk.h) and strategies/compressed.h specify it: what the kernels and the backend's mean must equal
bit for bit."""

from __future__ import annotations

import math

import torch

from torch_chainermn import codes as registry


def words_of(codes: torch.Tensor, per_word: int) -> torch.Tensor:
    """Codes (small ints, one per value) packed `per_word` a 32-bit word, value i at bits
    (32 // per_word) * (i % per_word), as int32."""
    bits = 32 // per_word
    padded = torch.zeros(math.ceil(codes.numel() / per_word) * per_word, dtype=torch.int64)
    padded[: codes.numel()] = codes.to(torch.int64)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (padded.view(-1, per_word) << shifts).sum(dim=1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


LEVELS = {"int8": 127.0, "4bit": 7.0, "int2": 1.0}  # the block codes: codes from -levels to levels
# A compressed mean's chunks are whole blocks for the codes that read one (the registry says which).
BLOCK_KINDS = tuple(code for code in registry.CODES if "block" in registry.describe(code)["reads"])


def block_code(kind: str, r: torch.Tensor, block: int):
    """(new residual, the values sent) of a block code: per block of `block` values, scale = largest
    |r| / levels, code = round_half_even(r x (levels / largest)), 0 where largest is 0."""
    levels = LEVELS[kind]
    sent = torch.zeros_like(r)
    for start in range(0, r.numel(), block):
        piece = r[start : start + block]
        largest = piece.abs().max()
        scale = largest / levels
        if largest > 0:
            # A true float32 division (a Python number over a tensor is a reciprocal times the number:
            # two roundings, which moves a code at a tie).
            inverse = torch.tensor(levels, dtype=torch.float32) / largest
            codes = torch.round(piece * inverse).clamp(-levels, levels)
            sent[start : start + block] = codes * scale
    return r - sent, sent


def topk_chosen(piece: torch.Tensor, keep: int) -> torch.Tensor:
    """The in-block indices top-k sends, in increasing order: the `keep` largest |r|, ties to the lower
    index (a stable sort keeps equal magnitudes in index order; -0 and +0 are equal)."""
    order = torch.sort(piece.abs(), descending=True, stable=True).indices
    return order[:keep].sort().values


def topk_code(r: torch.Tensor, block: int, keep: int):
    """(new residual, the values sent) of top-k: per block of `block` values, the chosen ones as int8
    codes against scale = largest |r| / 127 (code = round_half_even(r x (127 / largest))), 0 elsewhere."""
    sent = torch.zeros_like(r)
    for start in range(0, r.numel(), block):
        piece = r[start : start + block]
        largest = piece.abs().max()
        if largest > 0:
            chosen = topk_chosen(piece, keep)
            inverse = torch.tensor(127.0) / largest  # a true float32 division, as block_code's
            codes = torch.round(piece[chosen] * inverse).clamp(-127, 127)
            sent[start + chosen] = codes * (largest / 127)
    return r - sent, sent


def quantize(kind: str, residual: torch.Tensor, add, chunk: int, threshold: float, block: int = 256, keep: int = 8):
    """(block as int32 words, new residual, the values the block carries); for the block codes (int8,
    4bit, topk) the words are not written (None): their rows are checked in tests/test_codes.py."""
    if kind not in WRITTEN:
        raise KeyError(f"compression_reference.quantize: no reference for the {kind!r} code (add one here)")
    r = residual + add if add is not None else residual.clone()
    count = r.numel()
    if kind in LEVELS:
        new, sent = block_code(kind, r, block)
        return None, new, sent
    if kind == "topk":
        new, sent = topk_code(r, block, keep)
        return None, new, sent
    if kind == "2bit":
        t = torch.tensor(threshold, dtype=torch.float32)
        pos, neg = r >= t, r <= -t
        sent = pos.float() * t - neg.float() * t
        new = torch.where(pos, r - t, torch.where(neg, r + t, r))
        block = torch.zeros(math.ceil(chunk / 16), dtype=torch.int32)
        codes = words_of(pos.to(torch.int64) | (neg.to(torch.int64) << 1), 16)
        block[: codes.numel()] = codes
        return block, new, sent
    scale = torch.tensor(float(r.abs().double().sum() / count) if count else 0.0, dtype=torch.float32)
    positive = r >= 0
    sent = torch.where(positive, scale, -scale)
    block = torch.zeros(1 + math.ceil(chunk / 32), dtype=torch.int32)
    block[0] = scale.view(torch.int32)
    signs = words_of(positive.to(torch.int64), 32)
    block[1 : 1 + signs.numel()] = signs
    return block, r - sent, sent


# The codes this module writes plainly (quantize): tests/test_codes.py checks that every registered
# code is among them, so a code cannot be added without its reference.
WRITTEN = (*LEVELS, "topk", "2bit", "1bit")


def chunk_of(count: int, nodes: int, kind: str = "2bit", block: int = 256) -> int:
    words = math.ceil(math.ceil(count / nodes) / 32) * 32
    return math.ceil(words / block) * block if kind in BLOCK_KINDS else words


def result_kind_of(kind: str, compress_result) -> str:
    """The sums' code: the one compress_result names, else the kind itself."""
    return compress_result if isinstance(compress_result, str) else kind


def chunk_for(count: int, nodes: int, kind: str, compress_result=False, block: int = 256) -> int:
    """The chunk of a mean whose sums come back as compress_result says (whole blocks if either code has them)."""
    sums = result_kind_of(kind, compress_result) if compress_result else kind
    return chunk_of(count, nodes, kind if kind in BLOCK_KINDS else sums, block)


def compressed_mean_steps(
    inputs,
    nodes,
    steps,
    kind,
    threshold=0.5,
    compress_result=False,
    result_dtype=torch.float32,
    residuals=None,
    block=256,
    keep=8,
):
    """The backend's compressed mean of inputs[step][rank] (flat float32), step after step.

    nodes: the ranks of each node, in order. residuals: each node's starting first residual.
    compress_result: False, True (the sums in `kind` too) or the sums' code ("int8", "4bit").
    Returns ([step] -> the mean every rank gets, first residuals, second residuals) per node.
    """
    world = sum(len(ranks) for ranks in nodes)
    count = inputs[0][0].numel()
    first = [torch.zeros(count) if residuals is None else residuals[j].clone() for j in range(len(nodes))]
    result_kind = result_kind_of(kind, compress_result)
    chunk = chunk_for(count, len(nodes), kind, compress_result, block)
    second = [torch.zeros(chunk) for _ in nodes]
    means = []
    for step in range(steps):
        sums = []
        for ranks in nodes:
            total = inputs[step][ranks[0]].clone()
            for rank in ranks[1:]:
                total = total + inputs[step][rank]
            sums.append(total)
        if len(nodes) == 1:
            means.append(sums[0] * (1.0 / world))
            continue
        result = torch.zeros(chunk * len(nodes))
        for i in range(len(nodes)):  # node i sums chunk i of every node's codes
            lo, hi = min(i * chunk, count), min((i + 1) * chunk, count)
            chunk_sum = None
            for j in range(len(nodes)):
                _, first[j][lo:hi], sent = quantize(
                    kind, first[j][lo:hi], sums[j][lo:hi], chunk, threshold, block, keep
                )
                chunk_sum = sent if chunk_sum is None else chunk_sum + sent
            if compress_result:
                _, second[i][: hi - lo], chunk_sum = quantize(
                    result_kind, second[i][: hi - lo], chunk_sum, chunk, threshold, block, keep
                )
            elif result_dtype != torch.float32:
                chunk_sum = chunk_sum.to(result_dtype).float()
            result[lo:hi] = chunk_sum
        means.append(result[:count] * (1.0 / world))
    return means, first, second
