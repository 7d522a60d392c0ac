#!/usr/bin/env python
"""ChainerMN's slow-network experiment on one machine: DDP step time per allreduce mode and link rate.

Two tasks (--task): `synthetic` (the default, this docstring: step time of a large-gradient model)
and `lm` (time to a target validation loss of a small byte-level language model, low-communication
modes beside DDP; `run.py --task lm -h`, lm_task.py). Both run on jobs.py's sweep.

For every link rate (--rates; `none` = no shaping), the simulated cluster of netns.py is shaped to
that rate, and for every mode (--modes, see train.py) one job is run: K torchruns, one per node
namespace, M ranks each,

    ip netns exec cmnI env CHAINERMN_HOSTNAME=nodeI GLOO_SOCKET_IFNAME=eth0 \\
        .venv/bin/torchrun --nnodes K --node-rank I --nproc-per-node M \\
        --master-addr 10.77.0.1 --master-port P benchmarks/cluster/train.py --mode MODE ...

The runs go mode by mode, each mode at every rate back to back (repeat r: every mode, every rate),
and each cell is the median of its --repeats runs, so a slow minute of a busy machine does not land
between a mode's runs or on one mode alone. The table gives per mode and rate: the step time, the
throughput (samples/s over all ranks), the efficiency against the same mode with no limit, the
ratio to the unlimited time of the fastest mode, the compute alone, the communication alone and the
CPU cores the job kept busy; below it, the issue's target (issue 22: the best compressed mode within
1.15x of the best unlimited step time at 1 Gbit/s, within 1.3x at 500 Mbit/s) is checked for every
shaped rate. Written to --out-dir (default benchmarks/results/):
cluster.json (every run and the table), cluster.md and cluster.png.

The namespaces are created at the start and removed at the end, on errors and on Ctrl-C too
(--keep-up leaves them). Needs root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import jobs  # noqa: E402
import netns  # noqa: E402

TRAIN = HERE / "train.py"
TASKS = ("synthetic", "lm")
DEFAULT_MODES = (
    "gloo,flat,hierarchical,two_dimensional,flat+fp16,flat+db,flat+fp16+db,two_dimensional+fp16+db,"
    "flat+2bit,flat+2bit+db,flat+2bit+cr+db,flat+1bit+cr+db,flat+2bit+fp16+db"
)
DEFAULT_RATES = "none,1gbit,500mbit,100mbit"
HOOK_FLAGS = ("fp16", "bf16", "db", "2bit", "1bit", "cr")  # modes that need torch_chainermn.hooks
COMPRESSED = ("2bit", "1bit")  # the flags of gradient compression
# The target (issue 22): the best compressed mode's step time within this factor of the
# best unlimited mode's, per link rate.
TARGETS = {"1gbit": 1.15, "500mbit": 1.3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=TASKS, default="synthetic", help="lm: see `run.py --task lm -h`")
    jobs.add_cluster_args(p, modes=DEFAULT_MODES, rates=DEFAULT_RATES, run_timeout=400.0, name="cluster")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compute-steps", type=int, default=1, help="steps without communication (compute only)")
    p.add_argument("--comm-steps", type=int, default=1, help="rounds of allreduce without compute (comm only)")
    p.add_argument("--params", type=float, default=25.0, help="million parameters")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    p.add_argument("--threshold", type=float, default=0.5, help="2-bit compression's threshold (+2bit modes)")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: one table from earlier results (their runs pooled, medians per cell), written as --name",
    )
    return p.parse_args(argv)


def hooks_available() -> bool:
    return (REPO / "torch_chainermn" / "hooks.py").exists()


# ---------------------------------------------------------------------------------------- one run


def train_args(args, mode: str, rate: str) -> list:
    """train.py's arguments for one run (the same at every rate)."""
    return [
        "--mode",
        mode,
        "--params",
        str(args.params),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threshold",
        str(args.threshold),
        "--compute-steps",
        str(args.compute_steps),
        "--comm-steps",
        str(args.comm_steps),
        "--timeout",
        str(int(args.run_timeout)),
    ]


def describe(res: dict) -> str:
    fmt = lambda v: f"{v:.3f} s" if v is not None else "-"  # noqa: E731
    return (
        f"step {res['step_s']:.3f} s (min {res['step_min_s']:.3f}, max {res['step_max_s']:.3f}), compute only "
        f"{fmt(res.get('compute_s'))}, comm only {fmt(res.get('comm_s'))}, "
        f"{res['cpu_per_step_s'] / res['step_s']:.2f} cores busy, {res['samples_per_s']:.1f} samples/s"
    )


# ---------------------------------------------------------------------------------------- table


def summarise(runs: list, modes: list, rates: list) -> list:
    cells = {}
    for r in runs:
        if "error" not in r:
            cells.setdefault((r["mode"], r["rate"]), []).append(r)
    base_rate = "none" if "none" in rates else rates[0]
    rows = []
    for mode in modes:
        for rate in rates:
            got = cells.get((mode, rate), [])
            errs = [r["error"] for r in runs if r["mode"] == mode and r["rate"] == rate and "error" in r]
            row = {"mode": mode, "rate": rate, "runs": len(got), "errors": errs}
            if got:
                row["step_s"] = statistics.median(r["step_s"] for r in got)
                row["compute_s"] = (
                    statistics.median(r["compute_s"] for r in got if r.get("compute_s") is not None)
                    if any(r.get("compute_s") is not None for r in got)
                    else None
                )
                row["samples_per_s"] = got[0]["world_size"] * got[0]["batch"] / row["step_s"]
                for key in ("comm_s", "cpu_per_step_s"):
                    vals = [r[key] for r in got if r.get(key) is not None]
                    row[key] = statistics.median(vals) if vals else None
                row["all_step_s"] = [r["step_s"] for r in got]
            rows.append(row)
    by = {(r["mode"], r["rate"]): r for r in rows}
    base_steps = [by[(m, base_rate)]["step_s"] for m in modes if "step_s" in by.get((m, base_rate), {})]
    best_base = min(base_steps) if base_steps else None
    best_mode = next((m for m in modes if by.get((m, base_rate), {}).get("step_s") == best_base), None)
    for row in rows:
        if "step_s" not in row:
            continue
        own = by.get((row["mode"], base_rate), {}).get("step_s")
        row["efficiency"] = own / row["step_s"] if own else None
        row["vs_best_unlimited"] = row["step_s"] / best_base if best_base else None
    return rows, base_rate, best_base, best_mode


def markdown(rows, base_rate, best_base, best_mode, meta) -> str:
    out = [
        f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks, {meta['params_m']:.1f}M parameters "
        f"({meta['grad_mb']:.0f} MB fp32 gradient), batch {meta['batch']} per rank, median of "
        f"{meta['repeats']} run(s) x {meta['steps']} steps"
        f"{'; environment ' + ' '.join(meta['env']) if meta.get('env') else ''}"
        f"{'; 2-bit threshold ' + str(meta.get('threshold', 0.5)) if any(is_compressed(m) for m in meta['modes']) else ''}"
        f"; best with no limit ({base_rate}): "
        f"{best_mode} {best_base:.3f} s"
        if best_base
        else "no successful baseline run",
        "",
        f"| mode | link | step (s) | samples/s | efficiency vs same mode at {base_rate} "
        f"| x best at {base_rate} | compute only (s) | comm only (s) | CPU cores busy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "step_s" not in r:
            out.append(f"| {r['mode']} | {r['rate']} | FAILED: {'; '.join(r['errors']) or 'not run'} | | | | | | |")
            continue
        comp = f"{r['compute_s']:.3f}" if r.get("compute_s") is not None else "-"
        eff = f"{r['efficiency']:.0%}" if r.get("efficiency") else "-"
        vs = f"{r['vs_best_unlimited']:.2f}x" if r.get("vs_best_unlimited") else "-"
        comm = f"{r['comm_s']:.3f}" if r.get("comm_s") is not None else "-"
        cores = f"{r['cpu_per_step_s'] / r['step_s']:.2f}" if r.get("cpu_per_step_s") is not None else "-"
        out.append(
            f"| {r['mode']} | {r['rate']} | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | {eff} | {vs} "
            f"| {comp} | {comm} | {cores} |"
        )
    return "\n".join(out) + "\n"


def is_compressed(mode: str) -> bool:
    return any(flag in COMPRESSED for flag in mode.split("+")[1:])


def verdict(rows, base_rate) -> list:
    """The issue's target, per shaped rate: the best compressed mode (+2bit, +1bit) within TARGETS[rate]
    of the best unlimited step time of any mode (rates without a target: the ratio alone)."""
    by = {(r["mode"], r["rate"]): r for r in rows if "step_s" in r}
    base = {m: r["step_s"] for (m, rate), r in by.items() if rate == base_rate}
    if not base:
        return []
    best_base_mode = min(base, key=base.get)
    lines = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        if rate == base_rate:
            continue
        gloo = by.get(("gloo", rate))
        gloo_ratio = gloo["step_s"] / base["gloo"] if gloo and "gloo" in base else None
        compressed = [r for (m, rt), r in by.items() if rt == rate and is_compressed(m)]
        if not compressed:
            lines.append(f"- {rate}: no compressed mode was measured")
            continue
        best = min(compressed, key=lambda r: r["step_s"])
        vs_best = best["step_s"] / base[best_base_mode]
        vs_own = best["step_s"] / base[best["mode"]] if best["mode"] in base else None
        gloo_text = f"gloo {gloo_ratio:.2f}x its unlimited time" if gloo_ratio else "gloo not measured"
        own = f", {vs_own:.3f}x its own unlimited time" if vs_own else ""
        target = TARGETS.get(rate)
        outcome = (
            f"target {target}x {'MET' if vs_best <= target else 'not met'}" if target else "no target at this rate"
        )
        lines.append(
            f"- {rate} ({gloo_text}): best compressed mode {best['mode']} {best['step_s']:.3f} s = "
            f"{vs_best:.3f}x the best unlimited time ({best_base_mode} {base[best_base_mode]:.3f} s){own} "
            f"-> {outcome}"
        )
    return lines


def plot(rows, modes, rates, best_base, path: Path, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (.venv/bin/pip install matplotlib): no plot"
    by = {(r["mode"], r["rate"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(modes) + 2), 4.5))
    width = 0.8 / max(1, len(rates))
    for j, rate in enumerate(rates):
        xs = [i + (j - (len(rates) - 1) / 2) * width for i in range(len(modes))]
        ys = [by.get((m, rate), {}).get("step_s", 0.0) for m in modes]
        ax.bar(xs, ys, width, label=f"link {rate}")
    if best_base:
        ax.axhline(best_base, color="k", lw=0.8, ls="--", label="best, no limit")
        for (rate, factor), style in zip(TARGETS.items(), (":", "-.")):
            ax.axhline(
                factor * best_base, color="gray", lw=0.8, ls=style, label=f"{factor} x best, no limit ({rate} target)"
            )
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels(modes, rotation=20, ha="right")
    steps = [r["step_s"] for r in rows if "step_s" in r]
    log = bool(steps) and max(steps) > 8 * min(steps)  # a slow link's uncompressed steps would flatten the rest
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(f"step time (s{', log scale' if log else ''}), lower is better")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    task = argparse.ArgumentParser(add_help=False)
    task.add_argument("--task", choices=TASKS, default="synthetic")
    known, rest = task.parse_known_args(argv)
    if known.task == "lm":
        import lm_task

        return lm_task.main(rest)
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out_dir), args.name)
    rates = [netns.rate_label(r) for r in args.rates.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not hooks_available():
        skipped = [m for m in modes if m != "gloo" and any(f in m.split("+")[1:] for f in HOOK_FLAGS)]
        if skipped:
            print(f"torch_chainermn/hooks.py does not exist yet: skipping {', '.join(skipped)}", flush=True)
            modes = [m for m in modes if m not in skipped]
    started = time.time()
    runs, status = jobs.sweep(args, modes, rates, TRAIN, lambda mode, rate: train_args(args, mode, rate), describe)
    if not runs:
        return status or 1
    ok = [r for r in runs if "error" not in r]
    meta = {
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "batch": args.batch,
        "env": args.env,
        "threshold": args.threshold,
        "params_m": (ok[0]["params"] / 1e6) if ok else args.params,
        "grad_mb": (ok[0]["grad_mb"]) if ok else args.params * 4,
        "layers": args.layers,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rates": rates,
        "modes": modes,
        "command": " ".join(["benchmarks/cluster/run.py"] + argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "total_s": time.time() - started,
    }
    report(runs, meta, out_dir=Path(args.out_dir), name=args.name)
    return status


def report(runs: list, meta: dict, out_dir: Path, name: str) -> None:
    """Print the table and write NAME.json, NAME.md and NAME.png into out_dir."""
    modes, rates = meta["modes"], meta["rates"]
    rows, base_rate, best_base, best_mode = summarise(runs, modes, rates)
    table = markdown(rows, base_rate, best_base, best_mode, meta)
    checks = verdict(rows, base_rate)
    if checks:
        table += (
            "\nTarget (issue 22; the best compressed mode's step time within "
            + ", ".join(f"{f}x at {r}" for r, f in TARGETS.items())
            + " of the best unlimited mode's):\n"
            + "\n".join(checks)
            + "\n"
        )
    print("\n" + table)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "table": rows, "runs": runs}, indent=1))
    (out_dir / f"{name}.md").write_text(f"`{meta['command']}`\n\n{table}")
    title = (
        f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks, {meta['params_m']:.0f}M params, "
        f"batch {meta['batch']}/rank (simulated cluster, 2-core host)"
    )
    note = plot(rows, modes, rates, best_base, out_dir / f"{name}.png", title)
    print(note or f"wrote {out_dir}/{name}.{{json,md,png}} ({meta.get('total_s', 0):.0f} s of runs)")


def merge(paths: list, out_dir: Path, name: str) -> int:
    """One table from the runs of several earlier run.py results (same configuration)."""
    runs, metas = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs += data["runs"]
        metas.append(data["meta"])
    meta = dict(metas[0])
    key = ("nodes", "ranks_per_node", "batch", "params_m", "layers", "env")
    if any(
        tuple(m.get(k) for k in key) != tuple(meta.get(k) for k in key)
        or m.get("threshold", 0.5) != meta.get("threshold", 0.5)
        for m in metas
    ):
        print(
            "merge: the files were measured with different --nodes/--ranks-per-node/--batch/--params/--layers"
            "/--threshold",
            file=sys.stderr,
        )
        return 2
    meta["modes"] = list(dict.fromkeys(mo for m in metas for mo in m["modes"]))
    meta["rates"] = list(dict.fromkeys(r for m in metas for r in m["rates"]))
    meta["repeats"] = sum(m["repeats"] for m in metas)
    meta["total_s"] = sum(m.get("total_s", 0) for m in metas)
    meta["command"] = "; ".join(m["command"] for m in metas) + f" (merged: {', '.join(map(str, paths))})"
    report(runs, meta, out_dir, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
