"""The MNIST example, launched as users launch it: torchrun, and mpiexec with no extra environment."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import MPIEXEC, REPO, free_port

SCRIPT = REPO / "examples" / "mnist" / "train_mnist.py"


def launch(command, tmp_path: Path) -> dict:
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command + [str(SCRIPT), "--out", str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "final test accuracy" in result.stdout
    return json.loads(out.read_text())


def test_mnist_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                "--master-port", str(free_port())]
    summary = launch(torchrun, tmp_path)
    assert summary["world_size"] == 4 and summary["transport"] == "gloo"
    assert summary["final_accuracy"] >= 0.95, summary["final_accuracy"]


@pytest.mark.mpi
def test_mnist_under_mpiexec(tmp_path):
    mpiexec = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-n", "4", sys.executable]
    summary = launch(mpiexec, tmp_path)
    assert summary["world_size"] == 4 and summary["transport"] == "mpi"
    assert summary["final_accuracy"] >= 0.95, summary["final_accuracy"]
