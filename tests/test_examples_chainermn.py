"""The ChainerMN-way examples, launched as users launch them: MNIST with the communicator, scatter_dataset,
the multi-node optimizer, evaluator and checkpointer (killed and restarted, it resumes), under torchrun
and mpiexec; the ImageNet ResNet with multi-node BatchNorm, fp16 gradients and double buffering."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import MPIEXEC, REPO, launch, launcher_free_environment, torchrun

MNIST = REPO / "examples" / "mnist" / "train_mnist_chainermn.py"
IMAGENET = REPO / "examples" / "imagenet" / "train_imagenet.py"

# 15 steps per epoch on the digits set (1438 training samples; 4 ranks x 25 or 2 ranks x 50 per step);
# 6 epochs reach about 0.98.
EPOCHS = ("--epoch", "6")


def run_example(command, script: Path, *flags, env=None) -> subprocess.CompletedProcess:
    # No rendezvous variables (mpiexec must need none) and no CHAINERMN_* defaults from the caller.
    child_env = launcher_free_environment(drop_prefixes=("CHAINERMN_",))
    child_env["OMP_NUM_THREADS"] = "1"
    child_env.update(env or {})
    return launch(command + [str(script), *map(str, flags)], child_env, timeout=300)


def output_of(result: subprocess.CompletedProcess) -> str:
    return f"exit status {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def succeeded(result: subprocess.CompletedProcess, summary: Path) -> dict:
    assert result.returncode == 0, output_of(result)
    return json.loads(summary.read_text())


def epoch_lines(stdout: str) -> list:
    """The epochs rank 0 reported finishing, in order."""
    return [
        int(line.split()[1]) for line in stdout.splitlines() if line.startswith("epoch ") and "test/accuracy" in line
    ]


def test_mnist_chainermn_under_torchrun(tmp_path):
    # The default (hierarchical) communicator on two simulated nodes of two ranks: intra-node reduce,
    # allreduce between the node leaders, intra-node broadcast.
    checkpoints, summary = tmp_path / "checkpoints", tmp_path / "summary.json"
    result = run_example(
        torchrun(4),
        MNIST,
        *EPOCHS,
        "--batchsize",
        "25",
        "--checkpoint-dir",
        checkpoints,
        "--out",
        summary,
        env={"CHAINERMN_RANKS_PER_NODE": "2"},
    )
    run = succeeded(result, summary)
    assert "final test accuracy" in result.stdout
    assert (run["world_size"], run["transport"], run["communicator"]) == (4, "gloo", "hierarchical")
    assert run["resumed_from"] == 0 and epoch_lines(result.stdout) == [1, 2, 3, 4, 5, 6]
    assert [h["epoch"] for h in run["history"]] == [1, 2, 3, 4, 5, 6]
    assert run["final_accuracy"] >= 0.95, run["history"]
    assert not checkpoints.exists()  # finalize() removed every rank's snapshots, rank 0 the directory it made


def test_mnist_chainermn_killed_and_restarted_resumes(tmp_path):
    # Two ranks (two launches of four would double the start-up time), the two_dimensional
    # communicator (reduce-scatter and allgather within the node) and float16 gradients.
    checkpoints, summary = tmp_path / "checkpoints", tmp_path / "summary.json"
    flags = (
        *EPOCHS,
        "--batchsize",
        "50",
        "--communicator",
        "two_dimensional",
        "--allreduce-grad-dtype",
        "float16",
        "--checkpoint-dir",
        checkpoints,
        "--out",
        summary,
    )

    killed = run_example(torchrun(2), MNIST, *flags, "--die-after-epoch", 2)
    assert killed.returncode != 0, output_of(killed)
    assert "dying after epoch 2" in killed.stderr, output_of(killed)
    assert epoch_lines(killed.stdout) == [1, 2], output_of(killed)
    assert not summary.exists()
    left = sorted(path.name for path in checkpoints.iterdir())
    assert {f"mnist.{rank}.2" for rank in range(2)} <= set(left), left
    assert not any(".tmp-" in name for name in left), left

    restarted = run_example(torchrun(2), MNIST, *flags)
    run = succeeded(restarted, summary)
    assert "resumed from epoch 2" in restarted.stdout
    assert run["resumed_from"] == 2 and epoch_lines(restarted.stdout) == [3, 4, 5, 6], output_of(restarted)
    # The history of epochs 1 and 2 came back from the snapshot.
    assert [h["epoch"] for h in run["history"]] == [1, 2, 3, 4, 5, 6]
    first_run_accuracy = [
        line.split("test/accuracy")[1].split()[0] for line in killed.stdout.splitlines() if "test/accuracy" in line
    ]
    assert [f"{h['test/accuracy']:.4f}" for h in run["history"][:2]] == first_run_accuracy
    assert (run["communicator"], run["allreduce_grad_dtype"]) == ("two_dimensional", "float16")
    assert run["final_accuracy"] >= 0.95, run["history"]
    assert list(checkpoints.iterdir()) == []


@pytest.mark.mpi
def test_mnist_chainermn_under_mpiexec_flat_double_buffering(tmp_path):
    assert MPIEXEC is not None, "mpiexec is not installed (make install sets up Open MPI)"
    checkpoints, summary = tmp_path / "checkpoints", tmp_path / "summary.json"
    mpiexec = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable]
    result = run_example(
        mpiexec,
        MNIST,
        "--communicator",
        "flat",
        "--double-buffering",
        "--batchsize",
        "50",
        "--epoch",
        "5",
        "--checkpoint-dir",
        checkpoints,
        "--out",
        summary,
    )
    run = succeeded(result, summary)
    assert (run["world_size"], run["transport"], run["communicator"]) == (2, "mpi", "flat")
    assert run["double_buffering"] is True and epoch_lines(result.stdout) == [1, 2, 3, 4, 5]
    # One step stale, 2 x 50 per step: about 0.97 after 5 epochs.
    assert run["final_accuracy"] >= 0.93, run["history"]
    assert not checkpoints.exists()  # finalize() removed every rank's snapshots, rank 0 the directory it made


def test_imagenet_synthetic_mnbn_fp16_double_buffering(tmp_path):
    summary = tmp_path / "summary.json"
    iterations, batch = 4, 16
    result = run_example(
        torchrun(2),
        IMAGENET,
        "--synthetic",
        "--fp16",
        "--double-buffering",
        "--depth",
        "10",
        "--epoch",
        "1",
        "--iterations",
        iterations,
        "--batchsize",
        batch,
        "--synthetic-val-size",
        "64",
        "--out",
        summary,
    )
    run = succeeded(result, summary)
    assert run["mnbn"] is True and run["fp16"] is True and run["double_buffering"] is True
    assert run["allreduce_grad_dtype"] == "torch.float16" and run["world_size"] == 2
    assert run["steps_per_epoch"] == iterations
    (epoch,) = run["history"]
    assert epoch["images"] == iterations * batch * 2
    assert epoch["images_per_second"] > 0
    assert 0 < epoch["train/loss"] < 10 and 0 <= epoch["val/accuracy"] <= 1
    assert "throughput" in result.stdout and "images/s" in result.stdout
    assert f"{iterations}/{iterations}" in result.stderr  # the progress bar reached the end
