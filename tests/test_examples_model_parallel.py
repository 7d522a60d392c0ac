"""The model-parallel MNIST example as users launch it, under mpiexec (so the battery's Gloo runs are
complemented by the MPI transport): the MLP split over 2 processes, pipelined in 2 micro-batches,
trains exactly as the same MLP on one process (--check-single trains that one on rank 0 alongside)."""

import json
import sys

import pytest

from tests.support.harness import MPIEXEC, REPO, launch, launcher_free_environment

SCRIPT = REPO / "examples" / "model_parallel" / "train_mnist_model_parallel.py"


@pytest.mark.mpi
def test_split_mlp_under_mpiexec_matches_one_process(tmp_path):
    out = tmp_path / "summary.json"
    env = launcher_free_environment()
    env["OMP_NUM_THREADS"] = "1"
    command = [
        MPIEXEC,
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        "2",
        sys.executable,
        str(SCRIPT),
        "--epoch",
        "3",
        "--unit",
        "100",
        "--lr",
        "0.01",
        "-b",
        "50",
        "--pipeline",
        "2",
        "--check-single",
        "--out",
        str(out),
    ]
    result = launch(command, env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 2 and summary["transport"] == "mpi" and summary["micro_batches"] == 2
    assert summary["final_accuracy"] >= 0.9, summary["final_accuracy"]
    for entry in summary["history"]:  # the split model is the one-process model, epoch after epoch
        assert abs(entry["test/accuracy"] - entry["single/accuracy"]) <= 0.002, entry
