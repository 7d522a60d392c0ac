"""Faults of a real network between nodes: a link down past the timeout, a short flap, a restart from
the checkpoint once the link is back, and a rank that raises.

The nodes are network namespaces on one bridge (benchmarks/cluster/netns.py, brought up once for the
module): 2 nodes, one torchrun each, Gloo between them over the node's veth, shared memory within a
node. A link goes down as a node's port on the bridge does (`netns.set_link`): the node keeps its
address and routes, and nothing passes, as when a switch drops it. The job is
tests/support/network_fault_worker.py: a small model trained with mean_coalesced, every step's batch fixed
by (rank, step), so an unfaulted run gives the parameters every surviving run must end with.
Needs root, as `ip netns` does (CI runs as root); without it the module fails, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.harness import REPO, free_port, job_environment

sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
import netns  # noqa: E402

WORKER = REPO / "tests" / "support" / "network_fault_worker.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 30
SLACK_S = 10  # the bound: every rank fails within the group timeout + this


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        raise RuntimeError("tests/test_network_faults.py needs root for `ip netns` (CI runs as root)")
    netns.up(2)
    try:
        yield
    finally:
        netns.down()


class Job:
    """One torchrun per node, started together, each writing its ranks' reports to `out`."""

    def __init__(self, out: Path, *args: str, ranks_per_node: int = 1, restarts: int = 0):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.procs = []
        for node in range(2):
            env = job_environment(
                {"CHAINERMN_HOSTNAME": f"node{node}", "GLOO_SOCKET_IFNAME": netns.IFNAME, "PYTHONUNBUFFERED": "1"}
            )
            command = [
                "ip",
                "netns",
                "exec",
                netns.node_ns(node),
                str(TORCHRUN),
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(ranks_per_node),
                "--master-addr",
                netns.node_addr(0),
                "--master-port",
                str(port),
                "--max-restarts",
                str(restarts),
                str(WORKER),
                str(out),
                "--steps",
                str(STEPS),
                *args,
            ]
            log = open(out / f"node{node}.log", "w")
            self.procs.append(
                subprocess.Popen(
                    command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            log.close()

    def reports(self) -> dict:
        found = {}
        for path in self.out.glob("rank*.json"):
            try:
                report = json.loads(path.read_text())
            except ValueError:
                continue  # being replaced
            found[report["rank"]] = report
        return found

    def wait_until(self, reached, what: str, timeout: float = 60.0) -> None:
        """Until `reached(reports)` holds, reading the ranks' reports every 50 ms; it failing to within
        `timeout`, or a torchrun ending first, fails the test."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reports = self.reports()
            if reports and reached(reports):
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.05)
        raise AssertionError(f"the job did not reach {what}:\n{self.logs()}")

    def wait_for_step(self, step: int, timeout: float = 60.0) -> None:
        self.wait_until(lambda reports: all(r["steps"] >= step for r in reports.values()), f"step {step}", timeout)

    def wait(self, timeout: float) -> list:
        """Every torchrun's exit status; a job still running after `timeout` s is killed and fails."""
        deadline = time.monotonic() + timeout
        codes = []
        try:
            for p in self.procs:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job was still running after {timeout:.0f} s:\n{self.logs()}") from None
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        return codes

    def logs(self) -> str:
        return "\n".join(
            f"--- node{i} ---\n" + (self.out / f"node{i}.log").read_text(errors="replace")[-3000:] for i in range(2)
        )

    def params(self, rank: int) -> list:
        return torch.load(self.out / f"params{rank}.pt")


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def unfaulted(cluster, tmp_path_factory):
    """The parameters of the job run without faults, per rank."""
    job = Job(tmp_path_factory.mktemp("unfaulted"), "--pause", "0.02")
    assert job.wait(90) == [0, 0], job.logs()
    return [job.params(r) for r in range(2)]


def test_a_flap_shorter_than_the_timeout_is_ridden_out_exactly(unfaulted, tmp_path):
    job = Job(tmp_path, "--pause", "0.05", "--timeout", "20")
    job.wait_for_step(5)
    netns.set_link(1, up=False)
    before = {rank: report["steps"] for rank, report in job.reports().items()}
    time.sleep(3)  # the flap itself: 3 s down, well inside the 20 s timeout
    during = {rank: report["steps"] for rank, report in job.reports().items()}
    netns.set_link(1, up=True)
    # The flap held the training in flight: without it, 3 s is about 60 steps of 0.05 s; with it, at most
    # the step that was already under way finished.
    assert all(during[rank] <= before[rank] + 1 for rank in during), (before, during)
    assert job.wait(90) == [0, 0], job.logs()
    for rank in range(2):
        assert same(job.params(rank), unfaulted[rank]), rank


def test_a_link_down_past_the_timeout_fails_every_rank_naming_the_other_node(cluster, tmp_path):
    timeout = 5
    segments = set(os.listdir("/dev/shm"))
    job = Job(tmp_path, "--steps", "100000", "--pause", "0.02", "--timeout", str(timeout), ranks_per_node=2)
    job.wait_for_step(3)
    netns.set_link(1, up=False)
    down_at = time.time()
    try:
        codes = job.wait(timeout + SLACK_S + 20)  # the ranks' errors, then every process's exit
    finally:
        netns.set_link(1, up=True)
    assert all(code != 0 for code in codes), job.logs()
    reports = job.reports()
    assert sorted(reports) == [0, 1, 2, 3], job.logs()
    for rank, report in reports.items():
        error = report.get("error")
        assert error and error["type"] == "DistBackendError", (rank, report, job.logs())
        assert error["at"] - down_at < timeout + SLACK_S, (rank, error)
        message = error["message"]
        assert "timed out" in message, (rank, message)
        if rank in (0, 1):  # the store's node: the other node's ranks never said they waited
            assert "rank 2 (host node1" in message and "rank 3 (host node1" in message, (rank, message)
        else:  # cut off from the store: names the ranks it cannot reach
            assert "ranks 0,1 (host node0) unreachable or did not take part" in message, (rank, message)
    assert set(os.listdir("/dev/shm")) <= segments, "a shared-memory segment was left behind"


def test_the_job_restarts_from_its_checkpoint_once_the_link_is_back(unfaulted, tmp_path):
    timeout = 5
    job = Job(tmp_path, "--pause", "0.05", "--timeout", str(timeout), "--checkpoint", restarts=1)
    job.wait_for_step(8)
    netns.set_link(1, up=False)
    # Both nodes' ranks fail (each reports its error before it exits); node 1's torchrun then waits for
    # the store to restart them, which only the link's return lets it reach.
    job.wait_until(
        lambda reports: len(reports) == 2 and all("error" in r for r in reports.values()),
        "both ranks' errors",
        timeout + SLACK_S + 20,
    )
    netns.set_link(1, up=True)
    assert job.wait(120) == [0, 0], job.logs()
    for rank, report in job.reports().items():
        assert report["attempt"] == 1 and report["finished"], report
        assert 8 <= report["resumed_from"] < STEPS, report
        assert same(job.params(rank), unfaulted[rank]), rank


@pytest.mark.parametrize("hook", [False, True], ids=["plain", "except-hook"])
def test_a_rank_that_raises_is_named_by_the_other_node(cluster, tmp_path, hook):
    timeout = 10
    job = Job(
        tmp_path,
        "--pause",
        "0.02",
        "--timeout",
        str(timeout),
        "--raise-at",
        "5",
        "--raise-rank",
        "1",
        *(["--hook"] if hook else []),
    )
    codes = job.wait(60)
    assert codes[0] != 0 and codes[1] != 0, job.logs()
    raised, told = job.reports()[1]["error"], job.reports()[0]["error"]
    assert raised["type"] == "RuntimeError", raised
    assert told["type"] == "DistBackendError" and "rank 1 (host node1" in told["message"], told
    # Without the hook the peer hears of it when the raising process exits; with it, at once.
    assert told["at"] - raised["at"] < (2 if hook else timeout + SLACK_S), (told, raised)
    if not hook:
        assert "exited" in told["message"] and "died" not in told["message"], told
