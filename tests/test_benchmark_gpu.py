"""Smoke test of benchmarks/gpu.py: its CPU run with --quick produces every section's table, filled.

It checks that the script runs its three sections end to end (one-rank groups in process, the 2-rank
allreduce launch through benchmarks/allreduce.py) and that every expected row carries numbers; it
asserts nothing about speed. About 20 s on a 2-core machine, most of it process start-up.
"""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

NUMBER = re.compile(r"^-?\d+(\.\d+)?")


def tables_by_section(markdown: str) -> dict[str, list[list[dict]]]:
    """{'## heading': [table, ...]}, each table a list of rows {column header: cell}."""
    sections: dict[str, list[list[dict]]] = {}
    heading, header, table = None, None, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            heading, header, table = line, None, None
            sections[heading] = []
        elif line.startswith("|") and heading is not None:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header, table = cells, []
                sections[heading].append(table)
            elif not set("".join(cells)) <= set("-:"):  # not the |---| rule
                assert len(cells) == len(header), f"row {line!r} does not match header {header}"
                table.append(dict(zip(header, cells)))
        else:
            header = None
    return sections


def section(sections: dict, prefix: str) -> list[list[dict]]:
    found = [tables for heading, tables in sections.items() if heading.startswith(prefix)]
    assert found, f"no section starting with {prefix!r}; sections: {list(sections)}"
    return found[0]


def assert_numeric(row: dict, columns) -> None:
    for column in columns:
        assert NUMBER.match(row[column]), f"{column} of {row} is not a number"
        assert float(NUMBER.match(row[column]).group()) > 0, f"{column} of {row} is not positive"


def test_gpu_benchmark_cpu_quick(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, f"gpu.py failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    markdown = (out / "gpu.md").read_text()
    assert markdown.startswith("# chainermn vs torch on CPU"), markdown[:200]
    assert "FAILED" not in markdown and "WRONG" not in markdown, markdown
    sections = tables_by_section(markdown)

    # 1. packing: both models, every wire dtype, both implementations.
    (pack,) = section(sections, "## 1. Packing")
    assert {(r["model"].split()[0], r["wire"]) for r in pack} == {
        (model, wire) for model in ("ResNet-50", "Transformer") for wire in ("float16", "bfloat16", "float32")
    }
    assert {r["tensors"] for r in pack if r["model"].startswith("ResNet-50")} == {"161"}
    for r in pack:
        assert_numeric(
            r,
            [
                "chainermn ms",
                "chainermn GB/s",
                "chainermn of copy",
                "torch (gloo) ms",
                "torch GB/s",
                "torch of copy",
                "chainermn speedup",
            ],
        )

    # 2. DDP: every chainermn hook and torch's on gloo (bf16 is refused by DDP without CUDA + NCCL).
    (ddp,) = section(sections, "## 2. DDP step time")
    measured = {(r["backend"], r["hook"]) for r in ddp}
    expected = {("gloo", hook) for hook in ("none (DDP's allreduce)", "allreduce_hook", "fp16_compress_hook")}
    expected |= {
        ("chainermn", hook)
        for hook in (
            "none (DDP's allreduce)",
            "allreduce_hook",
            "fp16_compress_hook",
            "bf16_compress_hook",
            "double_buffering_hook",
            "double_buffering_hook, float16",
        )
    }
    assert measured == expected, measured ^ expected
    for r in ddp:
        assert_numeric(r, ["ms/step", "samples/s", "vs gloo DDP"])
    assert "Not measured: gloo bf16_compress_hook" in markdown

    # 3. all_reduce on 2 ranks: every size from 4K, the chainermn strategies against gloo, and latency.
    busbw, latency = section(sections, "## 3. all_reduce")
    assert [r["size"] for r in busbw] == ["4K", "16K"]
    for r in busbw:
        assert_numeric(r, ["hierarchical", "two_dimensional", "gloo", "memcpy"])
        assert re.search(r"\(\d+(\.\d+)?x\)$", r["hierarchical"]), r  # the ratio to gloo
    assert {r["contender"] for r in latency} == {"hierarchical", "two_dimensional", "gloo"}
    for r in latency:
        assert_numeric(r, ["latency (us)", "vs gloo"])
