"""Jobs on the simulated cluster of netns.py: what every task of run.py shares.

A job is K torchruns, one per node namespace, M ranks each, running a worker script:

    ip netns exec cmnI env CHAINERMN_HOSTNAME=nodeI GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \\
        .venv/bin/torchrun --nnodes K --node-rank I --nproc-per-node M \\
        --master-addr 10.77.0.1 --master-port P WORKER ... --json RESULT

Rank 0 of the worker writes its result (one JSON object) to RESULT. A sweep brings the cluster
up, runs one job per (mode, rate) (mode by mode, each mode at every rate back to back, repeated
--repeats times: a change of the machine's load falls between modes rather than between one
mode's rates), and removes the namespaces at the end, on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import netns  # noqa: E402

TORCHRUN = REPO / ".venv" / "bin" / "torchrun"
# Variables that would steer the children somewhere else than the simulated node they run on.
SCRUB = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "CHAINERMN_HOSTNAME",
    "CHAINERMN_RANKS_PER_NODE",
    "GLOO_SOCKET_IFNAME",
    "TORCHELASTIC_RUN_ID",
)


class Interrupted(Exception):
    pass


def add_cluster_args(p: argparse.ArgumentParser, *, modes: str, rates: str, run_timeout: float, name: str) -> None:
    """The options of the cluster and the sweep, the same for every task (defaults per task)."""
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rates", default=rates, help="comma-separated tc rates; none = no shaping")
    p.add_argument("--modes", default=modes, help="comma-separated modes of the task's worker")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for every rank (repeatable), e.g. CHAINERMN_SHM_CHUNK_BYTES=16777216",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per (mode, rate)")
    p.add_argument("--run-timeout", type=float, default=run_timeout, help="seconds before a run is killed")
    p.add_argument("--port", type=int, default=29500, help="first master port (one per run)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--name", default=name, help="stem of the output files")
    p.add_argument("--keep-up", action="store_true", help="leave the namespaces up at the end")


# ---------------------------------------------------------------------------------------- one job


def child_env(node: int, extra=()) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SCRUB and not k.startswith(("OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_"))
    }
    env.update(
        CHAINERMN_HOSTNAME=f"node{node}",
        GLOO_SOCKET_IFNAME=netns.IFNAME,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    for item in extra:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def kill_job(procs) -> None:
    """Stop each torchrun's whole session (it was started in its own), SIGTERM then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run_job(args, worker: Path, worker_args: list, mode: str, rate: str, port: int, log_dir: Path, live: list) -> dict:
    """One job of `worker` on the cluster as it is shaped now; its result with rate and elapsed_s
    added, or {"mode", "rate", "error", "elapsed_s", "log_tail"} if it failed."""
    tag = f"{mode.replace('+', '_')}-{netns.rate_label(rate)}-p{port}"
    result_path = log_dir / f"{tag}.json"
    result_path.unlink(missing_ok=True)
    procs, logs = [], []
    t0 = time.time()
    try:
        for i in range(args.nodes):
            log = open(log_dir / f"{tag}-node{i}.log", "w")
            logs.append(log)
            cmd = [
                "ip",
                "netns",
                "exec",
                netns.node_ns(i),
                str(TORCHRUN),
                "--nnodes",
                str(args.nodes),
                "--node-rank",
                str(i),
                "--nproc-per-node",
                str(args.ranks_per_node),
                "--master-addr",
                netns.node_addr(0),
                "--master-port",
                str(port),
                str(worker),
                *worker_args,
                "--json",
                str(result_path),
            ]
            p = subprocess.Popen(
                cmd, cwd=REPO, env=child_env(i, args.env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            procs.append(p)
            live.append(p)
        failed = None
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = f"node {bad[0][0]} exited with {bad[0][1]}"
                break
            if all(c == 0 for c in codes):
                break
            if time.time() - t0 > args.run_timeout:
                failed = f"timed out after {args.run_timeout:.0f} s"
                break
            time.sleep(0.2)
    finally:
        kill_job(procs)
        for p in procs:
            if p in live:
                live.remove(p)
        for log in logs:
            log.close()
    elapsed = time.time() - t0
    if failed is None and not result_path.exists():
        failed = "no result written"
    if failed:
        tails = []
        for i in range(args.nodes):
            text = (log_dir / f"{tag}-node{i}.log").read_text(errors="replace").strip().splitlines()
            tails.append(f"--- node{i} ---\n" + "\n".join(text[-15:]))
        return {
            "mode": mode,
            "rate": netns.rate_label(rate),
            "error": failed,
            "elapsed_s": elapsed,
            "log_tail": "\n".join(tails),
        }
    res = json.loads(result_path.read_text())
    res.update(rate=netns.rate_label(rate), elapsed_s=elapsed)
    return res


# ---------------------------------------------------------------------------------------- a sweep


def sweep(args, modes: list, rates: list, worker: Path, worker_args, describe) -> tuple[list, int]:
    """Run `worker` for every mode at every rate (see the module docstring).

    worker_args(mode, rate) -> the worker's arguments; describe(result) -> the line printed for a
    successful run. Returns (every run's result, exit status: 0, 1 if a run failed, 130 if
    interrupted)."""
    if os.geteuid() != 0:
        print("run.py needs root: it creates network namespaces (ip netns) and tc qdiscs", file=sys.stderr)
        return [], 2
    log_dir = Path(args.out_dir) / f"{args.name}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    def on_term(signum, frame):
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    live: list = []
    runs: list = []
    port = args.port
    status = 0
    try:
        netns.up(args.nodes, None)
        print(f"cluster up: {args.nodes} nodes x {args.ranks_per_node} ranks; rates {rates}; modes {modes}", flush=True)
        for rep in range(args.repeats):
            for mode in modes:
                for rate in rates:
                    netns.set_rate(rate)
                    res = run_job(args, worker, worker_args(mode, rate), mode, rate, port, log_dir, live)
                    port += 1
                    runs.append(res)
                    if "error" in res:
                        print(
                            f"[{rep}] {mode:>28} @ {rate:>7}: FAILED ({res['error']}) after "
                            f"{res['elapsed_s']:.0f} s\n{res['log_tail']}",
                            flush=True,
                        )
                        status = 1
                    else:
                        print(f"[{rep}] {mode:>28} @ {rate:>7}: {describe(res)} [{res['elapsed_s']:.0f} s]", flush=True)
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"\ninterrupted ({str(e) or 'Ctrl-C'}): stopping the jobs and removing the namespaces", flush=True)
        status = 130
    finally:
        kill_job(list(live))
        if not args.keep_up:
            netns.down()
    return runs, status
