#!/usr/bin/env python
"""The compression kernels beside memcpy: GB/s of bytes moved, and the ratio to memcpy.

What is measured (one process; on the CPU one thread by default: the kernels are single-threaded
loops, so torch's copy_ is held to one thread too; --threads changes torch's; --device cuda: the
same on the GPU, each timed loop ended by a synchronize), for every size N (float32 values):

  memcpy               dst.copy_(src) of N float32: reads 4N, writes 4N bytes
  2bit quantize        torch_chainermn._C.testing.quantize("2bit", add, residual, chunk=N, t): reads add
                       and residual (8N), writes residual (4N) and the codes (N/4 bytes: 2 bits a value)
  2bit dequantize+acc  _C.testing.dequantize("2bit", codes, out, N, t, accumulate=True): reads the
                       codes (N/4) and out (4N), writes out (4N)
  1bit quantize        as 2bit, codes N/8 bytes + the scale; the kernel makes two passes over the
                       residual (the scale, the chunk's mean magnitude, is needed before the signs),
                       counted as one: the bytes are what the operation needs, not what it happens to move
  1bit dequantize+acc  as 2bit, codes N/8 + 4 bytes
  torch 2bit quantize  the same 2-bit quantize in plain PyTorch, as tests/support/compression_reference.py
                       writes it (the reference the kernels are tested against); same bytes counted
  2bit / 1bit q+dq     quantize then dequantize+acc: both byte counts over both times, the issue's
                       target (issue 22: quantize + dequantize at >= 50% of memcpy bandwidth)
  int8 encode+feedback torch_chainermn.codes.encode(values, wire, residual, code="int8"), one row (FSDP's
                       gradients between nodes, qgZ): reads values and residual (8N), writes the residual
                       (4N), the codes (N) and a scale per --block values
  int8 encode          the same without a residual (FSDP's weights, qwZ): reads 4N, writes N + scales
  int8 decode          codes.decode(wire, out, code="int8"): reads N + scales, writes 4N
  int8 q+dq            encode+feedback then decode (issue 36's target: >= 50% of memcpy bandwidth)

Data: "dense codes" (add and residual uniform in (-t, t): about half the values send a code each call,
in no pattern a branch predictor learns), and for quantize also "sparse codes" (add ~ N(0, t/100):
about 1% send, as with small gradients): a kernel with data-dependent branches shows it there.

Each figure is the best over --repeats timed loops (each loop runs the operation enough times to
take about --seconds of work; a warm-up call first). GB/s = 1e9 bytes per second. The kernels'
codes are checked once per size against the reference (bit for bit); a mismatch is marked WRONG.
_C.testing.quantize allocates its block of codes (N/16 of the input's words) on every call; that
cost is not subtracted, its size (allocate + first touch of a block, timed alone) is in the notes.

Run it from the repository root (1-2 minutes on 2 cores, mostly the PyTorch reference at 64M):

    .venv/bin/python benchmarks/compression.py
    .venv/bin/python benchmarks/compression.py --sizes 1M,16M,64M --repeats 7

It prints a markdown table and writes benchmarks/results/compression.{md,json,png} (--out-dir,
--name; the plot needs matplotlib, otherwise it is skipped with a note).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))
DEFAULT_OUT_DIR = REPO / "benchmarks" / "results"
GB = 1e9
KINDS = ("2bit", "1bit")


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def human(n: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes", default="1M,16M,64M", help="comma-separated float32 value counts (K, M suffixes: 2**10, 2**20)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed loops per figure; the best is reported")
    p.add_argument("--seconds", type=float, default=0.2, help="about this much work per timed loop")
    p.add_argument("--threshold", type=float, default=0.5, help="2-bit threshold")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (memcpy, the PyTorch reference)")
    p.add_argument("--no-reference", action="store_true", help="skip the pure-PyTorch quantize")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the CUDA kernels; no PyTorch reference timed)")
    p.add_argument("--block", type=int, default=256, help="int8: values per scale")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--name", default="compression", help="stem of the output files")
    return p.parse_args(argv)


SYNCHRONIZE = [lambda: None]  # torch.cuda.synchronize with --device cuda: a loop's time includes its kernels


def best_time(fn, repeats: int, seconds: float) -> float:
    """Best over `repeats` loops of seconds per call; each loop is sized to about `seconds` of work."""
    sync = SYNCHRONIZE[0]
    fn()  # warm-up: page faults, caches, lazy initialisation
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-7)
    iters = max(1, min(10_000, int(seconds / once)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def int8_reference(r, block: int):
    """(codes, scales) of a row whose length is a multiple of `block`, by kernels/int8.h's rule, vectorised."""
    import torch

    blocks = r.view(-1, block)
    largest = blocks.abs().amax(dim=1)
    levels = torch.full_like(largest, 127.0)  # tensor by tensor: torch divides by a scalar as a product
    inverse = torch.where(largest > 0, levels / largest, torch.zeros_like(largest))
    codes = torch.round(blocks * inverse[:, None]).clamp(-127, 127).to(torch.int8)
    return codes.view(-1), largest / levels


def measure_int8(n: int, values, residual, block: int, record) -> None:
    """The int8 rows of the table: the operators FSDP's exchange calls, into buffers kept across calls."""
    import torch
    from torch_chainermn.codes import decode, encode, wire_row_bytes

    x, start = values.view(1, n), residual.view(1, n)
    wire = torch.empty(1, wire_row_bytes("int8", n, block), dtype=torch.uint8, device=x.device)
    out = torch.empty(1, n, device=x.device)
    scale_bytes = 4 * -(-n // block)
    kept = start.clone()
    encode(x, wire, kept, code="int8", block=block)
    # The rule in torch on the CPU (the CUDA kernels must give the same bits).
    r = (start + x).view(-1).cpu()
    codes, scales = int8_reference(r, block)
    got = wire.cpu()
    wrong_e = not (
        torch.equal(got[0, :n].view(torch.int8), codes)
        and torch.equal(got[0, -scale_bytes:].view(torch.float32), scales)
    )
    decode(wire, out, code="int8", block=block)
    sent = (codes.float().view(-1, block) * scales[:, None]).view(-1)
    wrong_d = not (torch.equal(out.view(-1).cpu(), sent) and torch.equal(kept.view(-1).cpu(), r - sent))
    kept = start.clone()
    e = best_time(lambda: encode(x, wire, kept, code="int8", block=block), ARGS.repeats, ARGS.seconds)
    record("int8 encode+feedback", "int8", 13 * n + scale_bytes, e, wrong_e)
    record(
        "int8 encode",
        "int8",
        5 * n + scale_bytes,
        best_time(lambda: encode(x, wire, None, code="int8", block=block), ARGS.repeats, ARGS.seconds),
    )
    d = best_time(lambda: decode(wire, out, code="int8", block=block), ARGS.repeats, ARGS.seconds)
    record("int8 decode", "int8", 5 * n + scale_bytes, d, wrong_d)
    record("int8 q+dq", "int8", 18 * n + 2 * scale_bytes, e + d, wrong_e or wrong_d)


ARGS = None


def code_bytes(kind: str, n: int) -> int:
    return (n + 15) // 16 * 4 if kind == "2bit" else 4 + (n + 31) // 32 * 4


def measure(args) -> dict:
    import torch
    import compression_reference as reference
    from torch_chainermn import _C

    global ARGS
    ARGS = args
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        SYNCHRONIZE[0] = torch.cuda.synchronize
    t = args.threshold
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    rows, notes = [], []
    for n in sizes:
        gen = torch.Generator().manual_seed(n)
        # Dense codes: |add| < t, uniform, so each call sends a code for about half the values, in no
        # pattern a branch predictor could learn (the same `add` every call: the residual rotates,
        # the statistics stay the same). Sparse: add ~ N(0, t/100), about 1% of the values send.
        add = ((torch.rand(n, generator=gen) * 2 - 1) * t).to(device)
        residual = ((torch.rand(n, generator=gen) * 2 - 1) * t).to(device)
        sparse_add = (torch.randn(n, generator=gen) * (t / 100)).to(device)
        out = torch.zeros(n, device=device)
        found = {}

        def record(op, kind, nbytes, seconds, wrong=False):
            found[op] = {
                "op": op,
                "kind": kind,
                "values": n,
                "bytes": nbytes,
                "time_s": seconds,
                "GBps": nbytes / seconds / GB,
                "wrong": wrong,
            }

        dst = torch.empty(n, device=device)
        record("memcpy", "memcpy", 8 * n, best_time(lambda: dst.copy_(add), args.repeats, args.seconds))
        del dst

        for kind in KINDS:
            cb = code_bytes(kind, n)
            # Bit-exact check of the codes and the new residual against the reference, once per size.
            start = residual.clone()
            block, new, expected = reference.quantize(kind, start.cpu(), add.cpu(), n, t)
            r = start.clone()
            got = _C.testing.quantize(kind, add, r, n, t)
            exact = device.type == "cpu" or kind == "2bit"  # CUDA's 1-bit scale: another order of the sum
            wrong_q = exact and not (torch.equal(got.cpu(), block) and torch.equal(r.cpu(), new))
            sent = torch.zeros(n, device=device)
            _C.testing.dequantize(kind, got, sent, n, t, False)
            wrong_d = exact and not torch.equal(sent.cpu(), expected)
            del block, new, expected, sent, start

            r = residual.clone()
            q = best_time(lambda: _C.testing.quantize(kind, add, r, n, t), args.repeats, args.seconds)
            record(f"{kind} quantize", kind, 12 * n + cb, q, wrong_q)
            r = residual.clone()
            q_sparse = best_time(lambda: _C.testing.quantize(kind, sparse_add, r, n, t), args.repeats, args.seconds)
            record(f"{kind} quantize, sparse codes", kind, 12 * n + cb, q_sparse)
            d = best_time(lambda: _C.testing.dequantize(kind, got, out, n, t, True), args.repeats, args.seconds)
            record(f"{kind} dequantize+acc", kind, 8 * n + cb, d, wrong_d)
            record(f"{kind} q+dq", kind, 20 * n + 2 * cb, q + d, wrong_q or wrong_d)
            record(f"{kind} q+dq, sparse codes", kind, 20 * n + 2 * cb, q_sparse + d)
            del r

        measure_int8(n, add, residual, args.block, record)

        if not args.no_reference and device.type == "cpu":
            r = residual.clone()
            record(
                "torch 2bit quantize",
                "torch",
                12 * n + code_bytes("2bit", n),
                best_time(lambda: reference.quantize("2bit", r, add, n, t), min(args.repeats, 3), args.seconds),
            )
            del r

        # What _C.testing.quantize's per-call allocation of its block costs: allocate and touch it.
        words = code_bytes("2bit", n) // 4
        pre = torch.empty(words, dtype=torch.int32, device=device)
        fresh = best_time(
            lambda: torch.empty(words, dtype=torch.int32, device=device).zero_(), args.repeats, args.seconds
        )
        reused = best_time(lambda: pre.zero_(), args.repeats, args.seconds)
        alloc = max(0.0, fresh - reused)
        notes.append(
            {"values": n, "alloc_s": alloc, "share_of_2bit_quantize": alloc / found["2bit quantize"]["time_s"]}
        )

        memcpy = found["memcpy"]["GBps"]
        for row in found.values():
            row["vs_memcpy"] = row["GBps"] / memcpy
            rows.append(row)
        del add, residual, sparse_add, out
    meta = {
        "sizes": sizes,
        "threads": args.threads,
        "device": str(device),
        "block": args.block,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        "threshold": t,
        "repeats": args.repeats,
        "seconds": args.seconds,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "command": " ".join(["benchmarks/compression.py"] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    return {"meta": meta, "rows": rows, "alloc": notes}


OPS = (
    "memcpy",
    "2bit quantize",
    "2bit quantize, sparse codes",
    "2bit dequantize+acc",
    "2bit q+dq",
    "2bit q+dq, sparse codes",
    "1bit quantize",
    "1bit quantize, sparse codes",
    "1bit dequantize+acc",
    "1bit q+dq",
    "1bit q+dq, sparse codes",
    "int8 encode+feedback",
    "int8 encode",
    "int8 decode",
    "int8 q+dq",
    "torch 2bit quantize",
)


def table(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    sizes = meta["sizes"]
    by = {(r["op"], r["values"]): r for r in rows}
    lines = [
        f"Compression kernels on {where(meta)}, best of {meta['repeats']} loops: "
        f"GB/s of bytes moved (x memcpy at the same size)",
        "",
        "| operation | bytes moved per value | " + " | ".join(f"{human(n)} values" for n in sizes) + " |",
        "|---|---|" + "---:|" * len(sizes),
    ]
    per_value = {
        "memcpy": "8",
        "2bit quantize": "12 + 1/4",
        "2bit dequantize+acc": "8 + 1/4",
        "2bit q+dq": "20 + 1/2",
        "1bit quantize": "12 + 1/8",
        "1bit dequantize+acc": "8 + 1/8",
        "1bit q+dq": "20 + 1/4",
        "torch 2bit quantize": "12 + 1/4",
        "int8 encode+feedback": "13 + 4/block",
        "int8 encode": "5 + 4/block",
        "int8 decode": "5 + 4/block",
        "int8 q+dq": "18 + 8/block",
    }
    per_value.update({f"{op}, sparse codes": per_value[op] for op in list(per_value) if op[0] in "12"})
    for op in OPS:
        if not any((op, n) in by for n in sizes):
            continue
        cells = []
        for n in sizes:
            r = by.get((op, n))
            if r is None:
                cells.append("-")
                continue
            cell = f"{r['GBps']:.2f} ({r['vs_memcpy']:.2f}x, {r['time_s'] * 1e3:.2f} ms)"
            cells.append(cell + (" WRONG" if r["wrong"] else ""))
        name = f"**{op}**" if op.endswith("q+dq") else op
        lines.append(f"| {name} | {per_value[op]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Notes:",
        "- memcpy is `dst.copy_(src)` of float32 (read + write counted); every row runs on one thread "
        "(the kernels are single-threaded loops). q+dq: quantize then dequantize+accumulate, both byte "
        "counts over both times.",
        "- Data: dense codes (add and residual uniform in (-t, t): a code for about half the values each "
        "call, in no learnable pattern) unless marked sparse codes (add ~ N(0, t/100): about 1% send); "
        "dequantize reads the dense codes.",
    ]
    alloc = ", ".join(
        f"{human(a['values'])}: {a['alloc_s'] * 1e3:.3f} ms = {a['share_of_2bit_quantize']:.1%}"
        for a in result["alloc"]
    )
    lines.append(
        f"- `_C.testing.quantize` allocates its block of codes on every call (the backend keeps it in "
        f"scratch); allocating and touching a 2-bit block, timed alone, is {alloc} of the 2-bit "
        f"quantize time (not subtracted)."
    )
    lines.append(
        "- 1-bit quantize passes over the residual twice (mean magnitude first, then the signs); counted "
        "once. `torch 2bit quantize` is tests/support/compression_reference.py's `quantize`, the reference the "
        "kernels are tested against (it also materialises the sent values and int64 codes)."
    )
    verdicts = []
    for kind in KINDS:
        for data in ("", ", sparse codes"):
            ratios = [by[(f"{kind} q+dq{data}", n)]["vs_memcpy"] for n in sizes if (f"{kind} q+dq{data}", n) in by]
            if ratios:
                worst = min(ratios)
                verdicts.append(
                    f"{kind}{data or ', dense codes'} {worst:.2f}x at worst -> {'MET' if worst >= 0.5 else 'not met'}"
                )
    if verdicts:
        lines.append(
            "- Target (issue 22: quantize + dequantize at >= 50% of memcpy bandwidth): " + "; ".join(verdicts) + "."
        )
    ratios = [by[("int8 q+dq", n)]["vs_memcpy"] for n in sizes if ("int8 q+dq", n) in by]
    if ratios:
        lines.append(
            f"- Target (issue 36: int8 quantise + dequantise at >= 50% of memcpy bandwidth), blocks of "
            f"{meta.get('block')}: {min(ratios):.2f}x at worst -> {'MET' if min(ratios) >= 0.5 else 'not met'}."
        )
    if "torch 2bit quantize" in {r["op"] for r in rows}:
        speedups = ", ".join(
            f"{human(n)}: {by[('2bit quantize', n)]['GBps'] / by[('torch 2bit quantize', n)]['GBps']:.0f}x"
            for n in sizes
            if ("torch 2bit quantize", n) in by
        )
        lines.append(f"- The C++ 2-bit quantize against the PyTorch reference: {speedups}.")
    return "\n".join(lines) + "\n"


def where(meta: dict) -> str:
    if meta.get("device", "cpu").startswith("cuda"):
        return f"CUDA ({meta.get('device_name', '')})"
    return f"CPU, {meta['threads']} thread(s)"


def plot(result: dict, path: Path) -> str:
    try:
        import matplotlib
    except ImportError:
        return f"matplotlib is not installed, so no plot was written (pip install matplotlib into {sys.executable})"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["meta"]["sizes"]
    by = {(r["op"], r["values"]): r for r in result["rows"]}
    ops = [op for op in OPS if op != "memcpy" and "q+dq" not in op and any((op, n) in by for n in sizes)]
    ops += [op for op in OPS if op.endswith("q+dq") and any((op, n) in by for n in sizes)]
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(sizes) * len(ops) + 3), 4.5))
    width = 0.8 / len(ops)
    for j, op in enumerate(ops):
        xs = [i + (j - (len(ops) - 1) / 2) * width for i in range(len(sizes))]
        ys = [by[(op, n)]["vs_memcpy"] if (op, n) in by else 0.0 for n in sizes]
        style = {"hatch": "//", "edgecolor": "white"} if op.endswith("q+dq") else {}
        ax.bar(xs, ys, width, label=op, **style)
    ax.axhline(1.0, color="gray", lw=0.9, label="memcpy")
    ax.axhline(0.5, color="k", lw=0.9, ls=":", label="50% of memcpy (issue 22, q+dq)")
    ax.set_xticks(
        range(len(sizes)), [f"{human(n)} values\n(memcpy {by[('memcpy', n)]['GBps']:.1f} GB/s)" for n in sizes]
    )
    ax.set_ylabel("GB/s of bytes moved / memcpy's (higher is better)")
    ax.set_title(f"Compression kernels against memcpy, {where(result['meta'])}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    text = table(result)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / f"{args.name}.md").write_text(f"`{result['meta']['command']}`\n\n{text}")
    print(plot(result, args.out_dir / f"{args.name}.png"))
    print(f"wrote {args.out_dir}/{args.name}.{{json,md}}")
    return 1 if any(r["wrong"] for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
