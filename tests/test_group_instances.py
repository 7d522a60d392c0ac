"""Each instance of a chainermn group keeps its own keys in the store, so torchrun's restarts (the agent's
store outlives the attempts) and groups destroyed and created again never use an old instance's shared-
memory segment or Gloo addresses.

One real elastic job (tests/elastic_worker.py) covers it all: two torchrun agents, as two nodes of an
`--nnodes 1:2` c10d rendezvous, one rank each, on this host (so the ranks share memory and Gloo too).
Every attempt destroys and re-creates its groups three times; rank 1 dies in the first attempt; the
second attempt trains and checkpoints. Before the instances had keys of their own, the second attempt
failed every time (the first attempt's segment name, or its Gloo addresses).
"""
import json
import os
import signal
import subprocess
import sys

import torch

from tests.harness import REPO, RankFailure, free_port, job_environment

WORKER = REPO / "tests" / "elastic_worker.py"
JOB_TIMEOUT_S = 120  # about 20 s here; a hang (old keys, old addresses) ends in a failed test


def orphan_segments() -> set:
    """Segments in /dev/shm named by chainermn whose creator is gone (chainermn-<pid>-<n>): leaked."""
    orphans = set()
    for name in os.listdir("/dev/shm"):
        if name.startswith("chainermn-"):
            pid = int(name.split("-")[1])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                orphans.add(name)
            except PermissionError:
                pass
    return orphans


def run_agents(commands: list, env: dict, timeout: float) -> list:
    """Start every command at once, each in a session of its own; (exit status, output) of each.
    A hang kills them all and fails."""
    procs = [subprocess.Popen(c, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for c in commands]
    results = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, output.decode(errors="replace")))
    except subprocess.TimeoutExpired:
        outputs = []
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            outputs.append(proc.communicate()[0].decode(errors="replace")[-3000:])
        raise RankFailure(f"the job was still running after {timeout:.0f} s:\n" + "\n----\n".join(outputs)) from None
    return results


def test_restarted_job_trains_with_fresh_groups_and_leaks_no_segment(tmp_path):
    orphans_before = orphan_segments()
    endpoint = f"127.0.0.1:{free_port()}"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "instances",
             # With fewer nodes than the maximum, wait this long for the other (default 30 s).
             "--rdzv-conf", "last_call_timeout=2", "--max-restarts", "1", str(WORKER), str(tmp_path)]
    results = run_agents([agent, agent], job_environment(), JOB_TIMEOUT_S)

    report = "\n----\n".join(f"agent exit status {rc}:\n{out[-3000:]}" for rc, out in results)
    assert (tmp_path / "rank1-died").exists(), report  # the first attempt did lose a rank
    assert all(rc == 0 for rc, _ in results), report
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == 2, result
    assert result["losses"][-1] < result["losses"][0] / 4, result  # it trained
    state = torch.load(tmp_path / "checkpoint.pt")
    assert set(state) == {"weight", "bias"} and state["weight"].shape == (1, 4)
    leaked = orphan_segments() - orphans_before
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"
