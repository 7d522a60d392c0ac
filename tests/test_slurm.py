"""Slurm: `srun -n N python train.py`, and sbatch scripts that run srun, need no extra environment.

The jobs run on a real one-node Slurm cluster started for this module (tests/support/slurm_cluster.py; `make
install` installs Debian's Slurm). What one node cannot show (several nodes, compact node lists) is
checked on the variables srun sets, as srun sets them for a task of a two-node step.
"""

import os

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from torch_chainermn import _launch, _slurm
from tests.support.harness import run_srun
from tests.support.slurm_cluster import slurm_cluster

# What srun 22.05 set for task 3 of `srun -N 2 -n 5` on node[07-08] (3 tasks on the first node, 2 on the
# second), less what does not matter here.
TASK_OF_TWO_NODES = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "1",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "5",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "3,2",
    "SLURM_TASKS_PER_NODE": "3,2",
}
# What sbatch sets for the batch script itself: one process, though SLURM_NTASKS is 2.
BATCH_SCRIPT = {
    "SLURM_JOB_ID": "3",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_TASKS_PER_NODE": "2",
}


def test_compact_node_lists_expand_as_scontrol_does():
    assert _slurm.expand_hostlist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert _slurm.expand_hostlist("a1,b[9-11],c") == ["a1", "b9", "b10", "b11", "c"]
    assert _slurm.expand_hostlist("rack[1-2]-n[08-09]") == ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]
    assert _slurm.tasks_on_node("2(x3),1", 2) == 2 and _slurm.tasks_on_node("2(x3),1", 3) == 1


def test_a_task_of_a_two_node_step_finds_the_store_on_the_first_node():
    assert _slurm.rendezvous_variables(TASK_OF_TWO_NODES) == {
        "RANK": "3",
        "WORLD_SIZE": "5",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node07",
        "MASTER_PORT": str(12000 + 16 * (4242 % 1250) + 1),
    }
    # Another step of the job, or another job, meets at another port; MASTER_* set by the user win.
    assert _slurm.store_port({**TASK_OF_TWO_NODES, "SLURM_STEP_ID": "2"}) != _slurm.store_port(TASK_OF_TWO_NODES)
    chosen = _slurm.rendezvous_variables({**TASK_OF_TWO_NODES, "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    assert (chosen["MASTER_ADDR"], chosen["MASTER_PORT"]) == ("h", "29500")


def test_only_srun_tasks_count_and_torchrun_variables_win():
    assert _slurm.launched(TASK_OF_TWO_NODES) and not _slurm.launched(BATCH_SCRIPT)
    saved, saved_record = dict(os.environ), _launch.record()
    try:
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"):
            os.environ.pop(name, None)
        os.environ.update(
            {
                **TASK_OF_TWO_NODES,
                "RANK": "1",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "torchrun-host",
                "MASTER_PORT": "29500",
            }
        )
        assert _launch.prepare_environment().launcher == "env"  # torchrun started by srun: torchrun's ranks
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("1", "2", "torchrun-host")
        assert "GROUP_RANK" not in os.environ
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            del os.environ[name]
        assert _launch.prepare_environment() == _launch.Launch("srun", True, 3, 5, 0, 2)
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("3", "5", "node07")
    finally:
        os.environ.clear()
        os.environ.update(saved)
        _launch._record = saved_record  # this process's own launch, as the rest of the suite expects


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("cluster")) as env:
        yield env["SLURM_CONF"]


def rank_report():
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    names = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
    )
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t[0].item(),
        "transport": torch_chainermn.transport(),
        "env": {n: os.environ.get(n) for n in names},
        "launch": _launch.record(),
    }


def test_srun_starts_a_job_with_no_extra_environment(slurm_conf):
    reports = run_srun(rank_report, 2, slurm_conf=slurm_conf, timeout=90, op_timeout=30)
    for rank, report in enumerate(reports):
        env = report["env"]
        assert (report["rank"], report["world"], report["sum"]) == (rank, 2, 3.0), report
        assert env["SLURM_PROCID"] == env["RANK"] == env["LOCAL_RANK"] == str(rank), env
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1", env
        assert env["MASTER_PORT"] == str(_slurm.store_port(env)), env
        assert report["transport"] == "gloo"  # no MPI in a plain srun
        assert report["launch"] == _launch.Launch("srun", True, rank, 2, rank, 2), report


@pytest.mark.mpi
def test_sbatch_script_running_srun_with_pmix_meets_over_mpi(slurm_conf):
    # Open MPI's ranks under srun --mpi=pmix are MPI's: chosen as under mpiexec, MPI carries the traffic.
    reports = run_srun(
        rank_report, 2, slurm_conf=slurm_conf, srun_args=["--mpi=pmix"], batch=True, timeout=90, op_timeout=30
    )
    assert [(r["rank"], r["world"], r["sum"]) for r in reports] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert all(r["transport"] == "mpi" and r["env"]["LOCAL_WORLD_SIZE"] == "2" for r in reports), reports
    assert [r["launch"].launcher for r in reports] == ["mpiexec", "mpiexec"], reports
