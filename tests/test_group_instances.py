"""Each instance of a chainermn group keeps its own keys in the store, so torchrun's restarts (the agent's
store outlives the attempts) and groups destroyed and created again never use an old instance's shared-
memory segment or Gloo addresses.

One real elastic job (tests/support/elastic_worker.py) covers it all, as the issue saw it: `torchrun
--standalone --nproc-per-node 2 --max-restarts 1` (c10d rendezvous; its agent's store outlives the
attempts), two ranks on this host sharing memory and Gloo. Every attempt destroys and re-creates its
groups three times; rank 1 dies in the first attempt; the second attempt trains and checkpoints.
Before the instances had keys of their own, the second attempt failed every time (the first attempt's
segment name, or its Gloo addresses). (Two agents as two nodes of an `--nnodes 1:2` rendezvous pass
too, but take 8 s more; tests/test_instance.py covers arrival orders a launcher cannot force.)
"""

import json
import os
import sys

import torch

from tests.support.harness import REPO, job_environment, run_job

WORKER = REPO / "tests" / "support" / "elastic_worker.py"
JOB_TIMEOUT_S = 120  # about 15 s here; a hang (old keys, old addresses) ends in a failed test


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


def test_restarted_job_trains_with_fresh_groups_and_leaks_no_segment(tmp_path):
    orphans_before = orphan_segments()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(WORKER),
        str(tmp_path),
    ]
    returncode, output = run_job(torchrun, job_environment(), JOB_TIMEOUT_S, what="torchrun")

    report = f"torchrun exited with {returncode}:\n{output[-6000:]}"
    assert (tmp_path / "rank1-died").exists(), report  # the first attempt did lose a rank
    assert returncode == 0, report
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == 2 and result["restart"] == "1", result  # written by the second attempt
    assert result["losses"][-1] < result["losses"][0] / 4, result  # it trained
    state = torch.load(tmp_path / "checkpoint.pt")
    assert set(state) == {"weight", "bias"} and state["weight"].shape == (1, 4)
    leaked = orphan_segments() - orphans_before
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"
