#!/usr/bin/env python
"""torchft under repeated SIGKILLs: how long until training goes on, and until the killed replica is back.

What it does
------------
Two replica groups of --ranks processes each train under torchft on this machine
(tests/support/torchft_replicas.py: torchft's Manager, DistributedDataParallel and OptimizerWrapper,
a lighthouse with min_replicas=1 in this process). torchft's reconfigurable group across the replicas
is torch_chainermn's `ProcessGroupChainerMN` in one run and torchft's own `ProcessGroupGloo` in the
other (the replica group's own process group is chainermn's or Gloo's alike), one run after the other
in the same invocation.

Every --kill-every seconds one replica's processes are all SIGKILLed from this process (os.kill, at
whatever point of its step they are), replica 1 first, then 0, and so on; it is started again at
once (new processes, same replica id; --restart-delay to wait first). A replica is killed only when
both replicas have trained together since the previous restart (otherwise the kill waits for that).
After --duration seconds both replicas stop 3 steps past the furthest one and exit.

Per kill:
- kill -> resumed: from the kill to the survivor's first step committed in a quorum formed after the
  kill (a step that was already past its allreduce may still commit at once, in the old quorum: that
  is not counted as resumed). With --heartbeat-timeout-ms H the lighthouse drops the dead replica
  after H ms: most of this time.
- kill -> rejoined: from the kill to the restarted replica's first committed step (it fetched the
  survivor's weights and optimizer state, and committed the same step as the survivor);
  start -> rejoined is the part after its processes were started.
- survivor steps while down: steps the survivor committed between the kill and the rejoin.
- failed steps: the survivor's steps that did not commit after the kill (its allreduce failed).

The check at the end: every rank of both replicas has the same parameters, bit for bit, and they are
those of a plain replay of the committed steps in one process (the batch of a step depends only on
its number and the group rank, and the averages are exact: tests/support/torchft_replicas.py), so a
lost step, a step applied twice, or a rejoin with stale weights or optimizer state shows.

The restarted ranks fork from a forkserver that has imported torch, torchft and torch_chainermn
(--start-method spawn: each restart also imports them, about 5 s here on 2 busy cores).

Run it
------
    .venv/bin/python benchmarks/torchft_kills.py                      # both backends, 120 s each
    .venv/bin/python benchmarks/torchft_kills.py --backends chainermn --duration 60 --kill-every 10

Prints a markdown table; writes it to --out-dir/--name.md, with every kill's times and the commits
of every replica as JSON (.json), and a PNG of the steps over time with the kills (.png; needs
matplotlib). Exits 1 if a check failed or a process did not exit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCHMARKS))  # allreduce.py: the plot's import, JSON
os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse (in this process) logs every quorum at INFO
from allreduce import import_pyplot, write_json  # noqa: E402

DEFAULT_OUT_DIR = BENCHMARKS / "results"
BACKENDS = ("chainermn", "gloo")
COLORS = {"chainermn": "tab:green", "gloo": "tab:brown"}  # as in allreduce.py's and ddp_step.py's plots
TARGET_RESUME_S = 5.0  # issue 39: kill to resumed training


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=list(BACKENDS),
        help="torchft process groups to run, one after the other (default: both)",
    )
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica group (default 2)")
    p.add_argument("--kill-every", type=float, default=15.0, help="seconds between kills (default 15)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of training with kills per backend")
    p.add_argument("--restart-delay", type=float, default=0.0, help="seconds between a kill and the restart")
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=2000,
        help="the lighthouse drops a replica silent this long (default 2000; torchft's own: 5000)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="the process groups' and the Manager's timeout, seconds (default 10)",
    )
    p.add_argument(
        "--start-method",
        choices=("forkserver", "spawn"),
        default="forkserver",
        help="how ranks start (default forkserver: torch already imported)",
    )
    p.add_argument(
        "--torchft-ddp-as-is",
        action="store_true",
        help="torchft 0.2.0's DDP comm hook unchanged (a survivor whose allreduce fails dies of "
        "its AssertionError; see tests/support/torchft_replicas.py)",
    )
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--name", default="torchft_kills", help="file names in --out-dir (default torchft_kills)")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.kill_every <= 0 or args.duration < args.kill_every:
        p.error("need --ranks >= 1, --kill-every > 0 and --duration >= --kill-every")
    return args


# ------------------------------------------------------------------------------------------ one run


def together(groups, since: float) -> bool:
    """Both replicas' current incarnations have committed a step in one quorum of both after `since`."""
    return all(any(c["t"] > since and c["participants"] == 2 for c in groups.commits(r)) for r in (0, 1))


def run_backend(backend: str, args, out: Path) -> dict:
    from tests.support.torchft_replicas import ReplicaGroups

    groups = ReplicaGroups(
        out,
        backend,
        replicas=2,
        ranks=args.ranks,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        timeout_s=args.timeout,
        deadline_s=args.duration + 600,
        start_method=args.start_method,
        torchft_ddp_as_is=args.torchft_ddp_as_is,
    )
    kills, ended, errors = [], {"codes": {}, "hung": []}, ""
    began = time.time()
    try:
        groups.start(0)
        groups.start(1)
        groups.wait_for(lambda: together(groups, 0), 300, f"{backend}: both replicas training together")
        t0 = time.time()
        print(
            f"{backend}: both replicas training after {t0 - began:.1f} s; killing one every {args.kill_every:g} s "
            f"for {args.duration:g} s",
            flush=True,
        )
        victim, due = 1, t0 + args.kill_every
        while due <= t0 + args.duration:
            time.sleep(max(0.0, due - time.time()))
            since = kills[-1]["restarted_at"] if kills else 0
            groups.wait_for(lambda: together(groups, since), 120, f"{backend}: both replicas together again")
            survivor = 1 - victim
            kill = {
                "victim": victim,
                "survivor": survivor,
                "victim_incarnation": groups.incarnation[victim],
                "survivor_incarnation": groups.incarnation[survivor],
                "waited_s": time.time() - due,
            }
            last = groups.commits(survivor)[-1]
            kill["quorum_before"] = last["quorum"]
            kill["killed_at"] = groups.kill(victim)
            kill["survivor_step_at_kill"] = groups.step(survivor)
            time.sleep(args.restart_delay)
            kill["restarted_at"] = time.time()
            kill["restarted_incarnation"] = groups.start(victim)
            kills.append(kill)
            print(
                f"{backend}: kill {len(kills)}: replica {victim} at step {kill['survivor_step_at_kill']}, "
                f"{kill['killed_at'] - t0:.1f} s in",
                flush=True,
            )
            victim, due = survivor, due + args.kill_every
        since = kills[-1]["restarted_at"]
        groups.wait_for(lambda: together(groups, since), 120, f"{backend}: the last restarted replica rejoining")
        stop = max(groups.step(0), groups.step(1)) + 3
        groups.stop_at(stop)
        ended = groups.join(60)
        errors = groups.errors()
    except AssertionError as failure:
        errors = str(failure)
    finally:
        groups.close()
    result = analyse(groups, kills, ended, errors)
    result["meta"] = {"backend": backend, "wall_s": time.time() - began}
    return result


def analyse(groups, kills: list, ended: dict, errors: str) -> dict:
    """Each kill's times, the runs' commits, and the end's checks."""
    for kill in kills:
        survivor = groups.progress(kill["survivor"], kill["survivor_incarnation"])
        t = kill["killed_at"]
        resumed = next(
            (r for r in survivor if r["committed"] and r["t"] > t and r["quorum"] != kill["quorum_before"]), None
        )
        rejoined = next(iter(groups.commits(kill["victim"], kill["restarted_incarnation"])), None)
        kill["resumed_s"] = resumed["t"] - t if resumed else None
        kill["rejoined_s"] = rejoined["t"] - t if rejoined else None
        kill["start_to_rejoined_s"] = rejoined["t"] - kill["restarted_at"] if rejoined else None
        kill["rejoined_step"] = rejoined["step"] if rejoined else None
        # Where the restart's time went: its rank 0 entered its function, had its replica group, had its
        # Manager and DDP; then its first step (quorum, fetching the weights) until the commit.
        kill["restart_phases"] = {
            e["event"]: e["t"] - kill["restarted_at"]
            for e in groups.progress(kill["victim"], kill["restarted_incarnation"], events=True)
        }
        # The survivor committed the same step (the restarted replica caught up, not started over).
        kill["caught_up"] = bool(rejoined) and any(r["committed"] and r["step"] == rejoined["step"] for r in survivor)
        end = rejoined["t"] if rejoined else float("inf")
        kill["survivor_steps_while_down"] = sum(1 for r in survivor if r["committed"] and t < r["t"] < end)
        kill["failed_steps"] = sum(1 for r in survivor if not r["committed"] and t < r["t"] < end)
        failed = next((r for r in survivor if not r["committed"] and t < r["t"] < end), None)
        kill["survivor_error"] = failed["error"].splitlines()[0] if failed and failed["error"] else None
        kill["failed_s"] = failed["t"] - t if failed else None  # the dead peer failed the survivor's allreduce
    commits = {f"{r}.{i}": groups.commits(r, i) for r in (0, 1) for i in range(groups.incarnation[r] + 1)}
    check = end_check(groups, ended)
    return {
        "kills": kills,
        "commits": commits,
        "check": check,
        "errors": errors,
        "exit_codes": {"/".join(map(str, k)): v for k, v in ended["codes"].items()},
        "hung": ended["hung"],
    }


def end_check(groups, ended: dict) -> dict:
    """The final parameters of every rank of both replicas: equal, and equal to the replay."""
    import torch

    from tests.support.torchft_replicas import replay

    try:
        finals = [groups.final(r, groups.incarnation[r], rank) for r in (0, 1) for rank in range(groups.ranks)]
    except FileNotFoundError as missing:
        return {"ok": False, "what": f"no final parameters: {missing}"}
    steps = sorted({f["step"] for f in finals})
    reference = finals[0]["params"]
    equal = all(all(torch.equal(a, b) for a, b in zip(reference, f["params"])) for f in finals[1:])
    expected = replay(groups.model, steps[-1], groups.ranks)
    replayed = all(torch.equal(a, b) for a, b in zip(reference, expected))
    killed = {k for k in groups.killed}
    exits = all(code == (-9 if (r, i) in killed else 0) for (r, i, _), code in ended["codes"].items())
    ok = equal and replayed and len(steps) == 1 and exits and not ended["hung"]
    what = (
        f"{len(finals)} ranks at step {steps}: "
        + ("bit-equal" if equal else "DIFFERENT")
        + ", "
        + ("= replay" if replayed else "NOT the replay")
        + ("" if exits else ", BAD EXIT CODES")
        + (f", HUNG {ended['hung']}" if ended["hung"] else "")
    )
    return {"ok": ok, "what": what, "steps": steps[-1], "shared_memory": finals[0].get("shared_memory")}


# ------------------------------------------------------------------------------------------ output


def spread(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def table(results: list, meta: dict) -> str:
    lines = [
        f"torchft, 2 replica groups x {meta['ranks']} ranks on this machine ({meta['cpus']} CPUs), one replica "
        f"SIGKILLed every {meta['kill_every']:g} s for {meta['duration']:g} s and restarted "
        f"({meta['start_method']}), lighthouse heartbeat timeout {meta['heartbeat_timeout_ms']} ms, "
        f"group timeout {meta['timeout']:g} s. Times in seconds, min / median / max over the kills.",
        "",
        "| torchft group | steps committed | kills | kill -> resumed | kill -> rejoined | start -> rejoined "
        "| survivor steps while down | failed steps (kill -> failed) | rejoined = survivor's step | end check |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        kills = r["kills"]
        caught = sum(1 for k in kills if k["caught_up"])
        lines.append(
            f"| {r['meta']['backend']} | {r['check'].get('steps', '-')} | {len(kills)} "
            f"| {spread([k['resumed_s'] for k in kills])} | {spread([k['rejoined_s'] for k in kills])} "
            f"| {spread([k['start_to_rejoined_s'] for k in kills])} "
            f"| {spread([k['survivor_steps_while_down'] for k in kills]).replace('.00', '')} "
            f"| {sum(k['failed_steps'] for k in kills)} ({spread([k['failed_s'] for k in kills])}) "
            f"| {caught} of {len(kills)} "
            f"| {'ok' if r['check']['ok'] else 'FAILED'}: {r['check']['what']} |"
        )
    lines.append("")
    lines.append(
        "Per kill (replica killed, survivor's step at the kill, kill -> resumed, kill -> rejoined, "
        "survivor's steps while it was down, the survivor's error for its failed step):"
    )
    lines.append("")
    for r in results:
        for n, k in enumerate(r["kills"], 1):
            fmt = lambda v: "-" if v is None else f"{v:.2f}"
            lines.append(
                f"- {r['meta']['backend']} {n}: replica {k['victim']} at step {k['survivor_step_at_kill']}, "
                f"resumed {fmt(k['resumed_s'])} s, rejoined {fmt(k['rejoined_s'])} s "
                f"(step {k['rejoined_step']}), {k['survivor_steps_while_down']} steps while down"
                + (
                    f", failed step {k['failed_s']:.2f} s after the kill: `{k['survivor_error'][:160]}`"
                    if k["survivor_error"]
                    else ""
                )
            )
    resumes = [k["resumed_s"] for r in results for k in r["kills"] if k["resumed_s"] is not None]
    if resumes:
        lines.append("")
        lines.append(
            f"Target (issue 39): kill -> resumed <= {TARGET_RESUME_S:g} s: "
            f"{sum(1 for v in resumes if v <= TARGET_RESUME_S)} of {len(resumes)} kills."
        )
    for r in results:
        if r["errors"]:
            lines.append(f"\n{r['meta']['backend']}: errors:\n```\n{r['errors'][-3000:]}\n```")
    return "\n".join(lines) + "\n"


def plot(results: list, meta: dict, path: Path) -> None:
    """Per backend: each replica's committed step over time (every incarnation), the kills."""
    plt = import_pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        commits = [c for cs in r["commits"].values() for c in cs]
        if not commits:
            continue
        t0 = min(c["t"] for c in commits)
        for key, cs in sorted(r["commits"].items()):
            replica = int(key.split(".")[0])
            ax.plot(
                [c["t"] - t0 for c in cs],
                [c["step"] for c in cs],
                ".",
                ms=5 if replica == 0 else 2,
                color="tab:blue" if replica == 0 else "tab:orange",
                label=f"replica {replica}" if key.endswith(".0") else None,
            )
        for n, k in enumerate(r["kills"]):
            ax.axvline(k["killed_at"] - t0, color="red", lw=0.8, label="SIGKILL" if n == 0 else None)
            if k["rejoined_s"] is not None:
                ax.axvline(
                    k["killed_at"] + k["rejoined_s"] - t0,
                    color="gray",
                    lw=0.8,
                    ls=":",
                    label="rejoined" if n == 0 else None,
                )
        resumed = [k["resumed_s"] for k in r["kills"] if k["resumed_s"] is not None]
        ax.set_title(
            f"torchft on {r['meta']['backend']}: {len(r['kills'])} kills, kill -> resumed median "
            f"{statistics.median(resumed) if resumed else float('nan'):.2f} s, end check "
            f"{'ok' if r['check']['ok'] else 'FAILED'}",
            fontsize=10,
        )
        ax.set_xlabel("seconds")
        ax.set_ylabel("committed step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    fig.suptitle(
        f"2 replica groups x {meta['ranks']} ranks, a SIGKILL every {meta['kill_every']:g} s, "
        f"heartbeat timeout {meta['heartbeat_timeout_ms']} ms ({meta['date']})",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def describe(args) -> dict:
    import torch
    import torchft  # noqa: F401

    from importlib.metadata import version

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    return {
        "ranks": args.ranks,
        "kill_every": args.kill_every,
        "duration": args.duration,
        "restart_delay": args.restart_delay,
        "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
        "timeout": args.timeout,
        "start_method": args.start_method,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg()[0],
        "torch": torch.__version__,
        "torchft": version("torchft"),
        "commit": commit.strip(),
        "machine": platform.machine(),
        "command": " ".join(["benchmarks/torchft_kills.py"] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    meta = describe(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="torchft-kills-") as tmp:
        for backend in args.backends:
            results.append(run_backend(backend, args, Path(tmp) / backend))
    meta["loadavg_end"] = os.getloadavg()[0]
    text = table(results, meta)
    text += (
        f"\n`{meta['command']}`, {meta['date']}, commit {meta['commit']}, torch {meta['torch']}, torchft "
        f"{meta['torchft']}; 1-minute load average {meta['loadavg_start']:.2f} at the start, "
        f"{meta['loadavg_end']:.2f} at the end.\n"
    )
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / f"{args.name}.json", {"meta": meta, "results": results})
    (args.out_dir / f"{args.name}.md").write_text(text)
    plot(results, meta, args.out_dir / f"{args.name}.png")
    print(f"wrote {args.out_dir}/{args.name}.{{json,md}}")
    return 0 if all(r["check"]["ok"] and not r["errors"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
