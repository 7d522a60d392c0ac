"""run.py --task lm: time to a target validation loss on the simulated cluster, per mode and rate.

Every mode of train_lm.py trains lm.py's byte-level language model on K nodes x M ranks at every
link rate. At the unlimited rate (`none`) every run takes the whole --steps budget, so the loss at
its end compares the modes at equal tokens (a mode's maths does not depend on the link rate, so the
unlimited run stands for every rate); at the shaped rates a run stops at the first evaluation at or
below --target-loss, or when --time-budget seconds of training clock or the step budget run out.

Output, like the synthetic task's: the table on stdout and in NAME.md, every run in NAME.json,
NAME.png (validation loss against training wall time, one panel per rate, one line per mode), and
the torchruns' logs in NAME-logs/ (under --out-dir, default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import jobs
import lm
import netns
import train_lm

WORKER = jobs.HERE / "train_lm.py"
DEFAULT_MODES = ",".join(train_lm.MODES)
DEFAULT_RATES = "none,1gbit,100mbit,10mbit"
BASE_RATE = "none"
# Issue 35's targets: the best chainermn mode's time to target within this factor of the best mode's
# at none, per rate; and DiLoCo or streaming keeping this much compute utilisation at 100 Mbit/s.
TARGETS = {"100mbit": 1.25, "10mbit": 2.0}
UTILISATION_TARGET = ("100mbit", ("diloco", "streaming", "streaming-ranks"), 0.95)
# Issue 61's: the best low-communication mode within 2% of DDP's loss at equal tokens and within this
# factor of the best time at none, per rate; the time before the first step at 1 Mbit/s under 5 s.
LOW_COMM_TARGETS = {"10mbit": 1.15, "1mbit": 1.5}
LOSS_GAP = 0.02
FIRST_STEP_TARGET = ("1mbit", 5.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="run.py --task lm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    jobs.add_cluster_args(p, modes=DEFAULT_MODES, rates=DEFAULT_RATES, run_timeout=150.0, name="lm")
    passed = p.add_argument_group("model and modes (passed to every rank)")
    lm.add_model_args(passed)
    train_lm.add_method_args(passed)
    train_lm.add_profile_args(p)  # --profile-dir DIR: each run's traces in DIR/<mode>-<rate>/
    p.add_argument("--target-loss", type=float, default=2.75, help="validation loss to reach (nats per byte)")
    p.add_argument("--steps", type=int, default=160, help="step budget per run")
    p.add_argument(
        "--time-budget",
        type=float,
        default=30.0,
        help="seconds of training clock per run at shaped rates (none: the step budget alone)",
    )
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--compute-steps", type=int, default=5)
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: one table from earlier results "
        "(their runs pooled, each cell the median of its runs by time to target), written as --name",
    )
    return p.parse_args(argv)


def passed_through() -> list:
    """The option names (dest) of lm.py's and train_lm.py's settings that every rank receives."""
    p = argparse.ArgumentParser(add_help=False)
    lm.add_model_args(p)
    train_lm.add_method_args(p)
    return [a.dest for a in p._actions]


def worker_args(args, mode: str, rate: str) -> list:
    out = [
        "--mode",
        mode,
        "--steps",
        str(args.steps),
        "--target-loss",
        str(args.target_loss),
        "--eval-every",
        str(args.eval_every),
        "--compute-steps",
        str(args.compute_steps),
        "--timeout",
        str(int(args.run_timeout)),
    ]
    for dest in passed_through():
        out += ["--" + dest.replace("_", "-"), str(getattr(args, dest))]
    if rate != BASE_RATE:
        out += ["--stop-at-target", "--time-budget", str(args.time_budget)]
    if args.profile_dir:
        folder = Path(args.profile_dir) / f"{mode.replace('+', '_')}-{rate}"
        out += [
            "--profile-dir",
            str(folder),
            "--profile-start",
            str(args.profile_start),
            "--profile-steps",
            str(args.profile_steps),
        ]
    return out


def describe(res: dict) -> str:
    counted = ""
    if res.get("tx_over_counted"):
        within = 1 <= res["tx_over_counted"] <= res["header_bound"]
        counted = (
            f" ({res['counted_tx_bytes'] / max(1, res['steps']) / 1e6:.3f} by the counters: interface / "
            f"counters {res['tx_over_counted']:.4f}, {'within' if within else 'OUTSIDE'} the headers' "
            f"1 to {res['header_bound']:.4f})"
        )
    if res["reached"]:
        head = f"target at step {res['steps_to_target']} after {res['time_to_target_s']:.1f} s"
    else:
        head = f"not reached: {res['final_val_loss']:.3f} after {res['steps']} steps, {res['clock_s']:.1f} s"
    return (
        f"{head}; last loss {res['final_val_loss']:.3f}, step {res['step_s']:.3f} s, compute "
        f"{res['compute_s'] or float('nan'):.3f} s, {res['bytes_per_step'] / 1e6:.3f} MB/step between nodes{counted}, "
        f"startup {res['startup_s']:.0f} s, first step after {first_step(res)}, eval {res['eval_s']:.1f} s"
        + (f", waited for exchanges at evaluations {res['flush_s']:.1f} s" if res.get("flush_s") else "")
    )


def first_step(res: dict) -> str:
    """The time before the first step, with its parts (older results: not measured)."""
    if res.get("first_step_s") is None:
        return "-"
    imports = f"imports {res['imports_s']:.1f} s, " if res.get("imports_s") is not None else ""
    return (
        f"{res['first_step_s']:.1f} s ({imports}process group up {res['init_s']:.1f} s, mode's set-up "
        f"{res['setup_s']:.1f} s)"
    )


# ---------------------------------------------------------------------------------------- table


def pick(runs: list, mode: str, rate: str) -> dict | None:
    """The cell's run: the median of its repeats by time to target (not reached counts as last)."""
    got = [r for r in runs if r["mode"] == mode and r["rate"] == rate and "error" not in r]
    if not got:
        return None
    got.sort(key=lambda r: (r["time_to_target_s"] if r["reached"] else float("inf"), r["final_val_loss"]))
    return got[len(got) // 2]


def summarise(runs: list, modes: list, rates: list) -> tuple[list, float | None, str | None]:
    base = {m: pick(runs, m, BASE_RATE) for m in modes}
    reached = {m: r["time_to_target_s"] for m, r in base.items() if r and r["reached"]}
    best_mode = min(reached, key=reached.get) if reached else None
    best = reached.get(best_mode)
    rows = []
    for mode in modes:
        for rate in rates:
            run = pick(runs, mode, rate)
            row = {
                "mode": mode,
                "rate": rate,
                "errors": [r["error"] for r in runs if r["mode"] == mode and r["rate"] == rate and "error" in r],
            }
            if run:
                row.update(
                    {
                        k: run[k]
                        for k in (
                            "reached",
                            "steps",
                            "steps_to_target",
                            "time_to_target_s",
                            "final_val_loss",
                            "bytes_per_step",
                            "compute_s",
                            "step_s",
                            "utilisation",
                            "clock_s",
                        )
                    }
                )
                row["first_step_s"] = run.get("first_step_s")
                row["vs_best"] = run["time_to_target_s"] / best if run["reached"] and best else None
                row["equal_tokens_loss"] = base[mode]["final_val_loss"] if base.get(mode) else None
            rows.append(row)
    return rows, best, best_mode


def exchange_lines(runs: list, meta: dict) -> list:
    """The task's compute-to-communication ratio: compute per step against the time one full-precision
    gradient exchange takes at each rate, from the bytes (so a reader can map a rate here to the
    same ratio on a real cluster)."""
    ok = [r for r in runs if "error" not in r and r.get("compute_s")]
    if not ok:
        return []
    compute = sorted(r["compute_s"] for r in ok)[len(ok) // 2]
    nodes = meta["nodes"]
    grad = ok[0]["params"] * 4
    # Between K node leaders an allreduce moves 2 (K-1)/K of the gradient each way on each link
    # (reduce-scatter, then all-gather); the node's ranks meet in shared memory first.
    per_link = grad * 2 * (nodes - 1) / nodes
    measured = [r for r in ok if r["mode"] == "chainermn" and r["rate"] == BASE_RATE]
    lines = [
        f"Compute per step (no communication, median over runs): {compute:.3f} s. One fp32 gradient "
        f"exchange ({grad / 1e6:.2f} MB; {per_link / 1e6:.2f} MB each way per node link"
        + (
            f"; measured for chainermn: {measured[0]['bytes_per_step'] / nodes / 1e6:.2f} MB sent per node "
            "and step, TCP/IP headers included"
            if measured
            else ""
        )
        + "):"
    ]
    for rate in meta["rates"]:
        bits = netns.parse_rate(rate)
        if bits is None:
            continue
        t = per_link * 8 / bits
        lines.append(f"- {rate}: {t:.3f} s, compute / communication = {compute / t:.2f}")
    return lines


def _seconds(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def target_lines(rows: list, best: float | None) -> list:
    """The issue's targets, checked on this run's table."""

    def ratio(row):
        return f"{row['time_to_target_s'] / best:.2f}x" if row and row.get("reached") and best else "not reached"

    lines = ["Targets (issue 35; chainermn = every mode but gloo):"]
    for rate, factor in TARGETS.items():
        at_rate = {r["mode"]: r for r in rows if r["rate"] == rate and "reached" in r}
        if not at_rate:
            continue
        ours = [r for m, r in at_rate.items() if m != "gloo" and r["reached"]]
        others = ", ".join(f"{m} {ratio(at_rate.get(m))}" for m in ("gloo", "powersgd") if m in at_rate)
        if not ours or not best:
            lines.append(f"- {rate}: no chainermn mode reached the target ({others}) -> not met")
            continue
        top = min(ours, key=lambda r: r["time_to_target_s"])
        met = top["time_to_target_s"] / best <= factor
        lines.append(
            f"- {rate}: best chainermn mode {top['mode']} {top['time_to_target_s']:.1f} s = {ratio(top)} "
            f"the best at {BASE_RATE} (target {factor}x; {others}) -> {'met' if met else 'not met'}"
        )
    rate, modes, floor = UTILISATION_TARGET
    found = [r for r in rows if r["rate"] == rate and r["mode"] in modes and r.get("utilisation")]
    if found:
        top = max(found, key=lambda r: r["utilisation"])
        lines.append(
            f"- compute utilisation at {rate}: "
            + ", ".join(f"{r['mode']} {r['utilisation']:.0%}" for r in found)
            + f" (target {floor:.0%}) -> {'met' if top['utilisation'] >= floor else 'not met'}"
        )
    return lines


def markdown(rows: list, best: float | None, best_mode: str | None, meta: dict, runs: list) -> str:
    s = meta["settings"]
    out = [
        f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks; {meta['corpus']}",
        f"model {meta['params'] / 1e6:.3f}M parameters (dim {s['dim']}, {s['layers']} layers, context "
        f"{s['context']}), batch {s['batch']} x {s['context']} bytes per rank, AdamW lr {s['lr']}; "
        f"target {meta['target_loss']}, budget {meta['steps']} steps, {meta['time_budget']:.0f} s of "
        f"training at shaped rates; evaluation every {meta['eval_every']} steps (clock paused)",
        f"thresholds: gradients {s['threshold']}, streaming's outer gradients {s['outer_threshold']}, "
        f"FSDP's gradients {s.get('fsdp_threshold', '-')}; "
        f"H={s['sync_every']}, streaming F={s['fragments']} tau={s['fragment_delay']}; "
        f"PowerSGD rank {s['powersgd_rank']}",
        (
            f"best at {BASE_RATE}: {best_mode}, target after {best:.1f} s"
            if best
            else f"no mode reached the target at {BASE_RATE}"
        ),
        "",
        "| mode | link | time to target (s) | steps to target | x best at none | loss at end of run "
        f"| loss at {meta['steps']} steps (equal tokens) | MB between nodes / step | compute / step (s) "
        "| step (s) | compute utilisation | before 1st step (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "reached" not in r:
            out.append(
                f"| {r['mode']} | {r['rate']} | FAILED: {'; '.join(r['errors']) or 'not run'} | | | | | | | | | |"
            )
            continue
        if r["reached"]:
            ttt, stt = f"{r['time_to_target_s']:.1f}", str(r["steps_to_target"])
        else:
            ttt, stt = f"not reached ({r['clock_s']:.0f} s)", f"- ({r['steps']} run)"
        vs = f"{r['vs_best']:.2f}x" if r.get("vs_best") else "-"
        eq = f"{r['equal_tokens_loss']:.3f}" if r.get("equal_tokens_loss") is not None else "-"
        util = f"{r['utilisation']:.0%}" if r.get("utilisation") else "-"
        out.append(
            f"| {r['mode']} | {r['rate']} | {ttt} | {stt} | {vs} | {r['final_val_loss']:.3f} | {eq} "
            f"| {r['bytes_per_step'] / 1e6:.3f} | {_seconds(r['compute_s'])} | {r['step_s']:.3f} | {util} "
            f"| {_seconds(r.get('first_step_s'), 1)} |"
        )
    out += [
        "",
        f"Loss at equal tokens: each mode's run at {BASE_RATE} (the whole step budget); a mode's "
        "maths does not depend on the link rate, so it holds for every rate. Time excludes "
        "evaluations; compute utilisation = steps x compute per step / training time. Before 1st step: "
        "the slowest rank's time from its process's start (interpreter and imports included, torchrun's "
        "own start not) to its first training step, the first evaluation left out.",
        "",
    ]
    out += exchange_lines(runs, meta)
    out += [""] + target_lines(rows, best)
    out += [""] + low_comm_lines(rows, best, best_mode)
    return "\n".join(out) + "\n"


def low_comm_lines(rows: list, best: float | None, best_mode: str | None) -> list:
    """Issue 61's targets: loss at equal tokens against DDP's, the time to target against the best at
    none (also normalised by each run's compute per step, which a busy machine stretches), and the
    time before the first step."""
    ddp = next(
        (
            r
            for r in rows
            if r["mode"] in ("chainermn", "gloo") and r["rate"] == BASE_RATE and r.get("final_val_loss") is not None
        ),
        None,
    )
    low = [m for m in dict.fromkeys(r["mode"] for r in rows) if m in train_lm.LOCAL_MODES]
    if ddp is None or not low:
        return []
    by = {(r["mode"], r["rate"]): r for r in rows if "reached" in r}
    base = by.get((best_mode, BASE_RATE))
    lines = [f"Targets (issue 61; DDP = {ddp['mode']}, loss at equal tokens {ddp['final_val_loss']:.3f}):"]
    close = []
    for m in low:
        r = by.get((m, BASE_RATE))
        if r is None:
            continue
        gap = r["final_val_loss"] / ddp["final_val_loss"] - 1
        close += [m] if gap <= LOSS_GAP else []
        lines.append(
            f"- {m}: loss at equal tokens {r['final_val_loss']:.3f} ({gap:+.1%} against DDP; target "
            f"{LOSS_GAP:.0%}) -> {'met' if gap <= LOSS_GAP else 'not met'}"
        )
    for rate, factor in LOW_COMM_TARGETS.items():
        got = [by[(m, rate)] for m in low if (m, rate) in by]
        if not got or not best:
            continue
        parts, met = [], False
        for r in got:
            if not r["reached"]:
                parts.append(f"{r['mode']} not reached")
                continue
            x = r["time_to_target_s"] / best
            norm = (
                (r["time_to_target_s"] / r["compute_s"]) / (best / base["compute_s"])
                if r.get("compute_s") and base and base.get("compute_s")
                else None
            )
            met |= x <= factor and r["mode"] in close
            parts.append(
                f"{r['mode']} {r['time_to_target_s']:.1f} s = {x:.2f}x"
                + (f" ({norm:.2f}x in compute steps)" if norm else "")
            )
        lines.append(
            f"- {rate}: " + ", ".join(parts) + f" the best at {BASE_RATE} ({best_mode} {best:.1f} s; "
            f"target {factor}x with the loss within {LOSS_GAP:.0%}) -> {'met' if met else 'not met'}"
        )
    rate, limit = FIRST_STEP_TARGET
    got = [r for r in rows if r["rate"] == rate and r.get("first_step_s") is not None]
    if got:
        lines.append(
            f"- before the first step at {rate}: "
            + ", ".join(f"{r['mode']} {r['first_step_s']:.1f} s" for r in got)
            + f" (target {limit:.0f} s) -> {'met' if min(r['first_step_s'] for r in got if r['mode'] in low) < limit else 'not met'}"
            if any(r["mode"] in low for r in got)
            else ""
        )
    return lines


def plot(runs: list, modes: list, rates: list, target: float, path: Path, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (.venv/bin/pip install matplotlib): no plot"
    cols = min(2, len(rates))
    rows = (len(rates) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, rate in zip(axes.flat, rates):
        for i, mode in enumerate(modes):
            run = pick(runs, mode, rate)
            if run is None:
                continue
            h = run["history"]
            ax.plot(
                [p["clock_s"] for p in h],
                [p["val_loss"] for p in h],
                label=mode,
                color=colors[i % len(colors)],
                ls="-" if i < len(colors) else "--",
                lw=1.2,
            )
        ax.axhline(target, color="k", lw=0.8, ls=":")
        ax.set_title(f"link {rate}", fontsize=9)
        ax.set_xlabel("training wall time (s, evaluations excluded)")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    for ax in list(axes.flat)[len(rates) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------- main


def main(argv) -> int:
    args = parse_args(argv)
    rates = [netns.rate_label(r) for r in args.rates.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in train_lm.MODES]
    if unknown:
        print(f"unknown modes {unknown}: the modes are {', '.join(train_lm.MODES)}", file=sys.stderr)
        return 2
    if args.merge:
        return write(args, *merged(args.merge))
    started = time.time()
    runs, status = jobs.sweep(args, modes, rates, WORKER, lambda mode, rate: worker_args(args, mode, rate), describe)
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return status or 1
    meta = {
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "rates": rates,
        "modes": modes,
        "params": ok[0]["params"],
        "corpus": ok[0]["corpus"],
        "settings": ok[0]["settings"],
        "target_loss": args.target_loss,
        "steps": args.steps,
        "time_budget": args.time_budget,
        "eval_every": args.eval_every,
        "env": args.env,
        "command": " ".join(["benchmarks/cluster/run.py", "--task", "lm"] + list(argv)),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "total_s": time.time() - started,
    }
    return write(args, meta, runs) or status


def merged(paths: list) -> tuple[dict, list]:
    """The first file's description and every file's runs (its modes and rates, in first-seen order)."""
    loaded = [json.loads(Path(path).read_text()) for path in paths]
    meta = dict(loaded[0]["meta"])
    for other in loaded[1:]:
        meta["modes"] += [m for m in other["meta"]["modes"] if m not in meta["modes"]]
        meta["rates"] += [r for r in other["meta"]["rates"] if r not in meta["rates"]]
    meta["command"] = "benchmarks/cluster/run.py --task lm --merge " + " ".join(map(str, paths))
    meta["total_s"] = sum(d["meta"]["total_s"] for d in loaded)
    return meta, [run for d in loaded for run in d["runs"]]


def write(args, meta: dict, runs: list) -> int:
    """The table (stdout, NAME.md), every run (NAME.json) and the plot (NAME.png)."""
    modes, rates = meta["modes"], meta["rates"]
    rows, best, best_mode = summarise(runs, modes, rates)
    table = markdown(rows, best, best_mode, meta, runs)
    print("\n" + table)
    out_dir = Path(args.out_dir)
    (out_dir / f"{args.name}.json").write_text(json.dumps({"meta": meta, "table": rows, "runs": runs}, indent=1))
    (out_dir / f"{args.name}.md").write_text(
        f"`{meta['command']}` ({meta['date']}, {meta['total_s']:.0f} s)\n\n{table}"
    )
    title = (
        f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks, byte-level LM {meta['params'] / 1e6:.2f}M "
        f"params on the Python stdlib\n(simulated cluster, 2-core host); dotted: target {meta['target_loss']}"
    )
    note = plot(runs, modes, rates, meta["target_loss"], out_dir / f"{args.name}.png", title)
    print(note or f"wrote {out_dir}/{args.name}.{{json,md,png}} ({meta['total_s']:.0f} s of runs)")
    return 0
