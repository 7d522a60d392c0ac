"""The launch record (torch_chainermn/_launch.py): who started this process is decided in one place,
from the launcher's variables, and every rank of a real job sees its own launcher, rank and size."""

import re
from pathlib import Path

import pytest

from torch_chainermn import _C, _launch
from tests.support.harness import run_mpiexec, run_spawn

REPO = Path(__file__).resolve().parents[1]
SRUN_TASK = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}


def test_the_launcher_is_read_from_its_variables():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert _launch._launcher(torchrun) == "env"
    assert _launch._read("env", torchrun) == _launch.Launch("env", True, 1, 2, 1, 2)
    assert _launch._launcher({**torchrun, "OMPI_COMM_WORLD_SIZE": "2", **SRUN_TASK}) == "env"  # set wins
    assert _launch._launcher(SRUN_TASK) == "srun"
    assert _launch._launcher({"PMIX_RANK": "0", **SRUN_TASK}) == ("mpiexec" if _C.mpi_built else "srun")
    assert _launch._launcher({"WORLD_SIZE": "4"}) == "env"
    nobody = _launch._read(_launch._launcher({}), {})
    assert nobody == _launch.Launch("none", False, None, None, None, None) and nobody.describe() == ("?", "?")


def test_an_mpiexec_rank_without_env_variables_still_knows_its_rank():
    # Before MPI fills in env:// (or in a build without MPI), the launcher's own names say the rank.
    launch = _launch._read("mpiexec", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"})
    assert (launch.rank, launch.world_size, launch.rendezvous) == (3, 4, False)
    assert _launch._read("mpiexec", {"PMI_RANK": "2", "PMI_SIZE": "5"}).describe() == ("2", "5")


def test_nothing_else_reads_a_launcher_s_variables():
    pattern = re.compile(
        r'environ(\.get)?[\[(]\s*"(RANK|WORLD_SIZE|LOCAL_RANK|OMPI_COMM_WORLD_\w+|PMI\w*|SLURM_\w+)"'
        r'|"(RANK|WORLD_SIZE)" in (os\.)?environ'
    )
    readers = [
        str(path.relative_to(REPO))
        for path in REPO.glob("torch_chainermn/**/*.py")
        if path.name not in ("_launch.py", "_slurm.py") and pattern.search(path.read_text())
    ]
    assert readers == []
    cpp = [str(path.relative_to(REPO)) for path in REPO.glob("csrc/**/*.[ch]*") if "getenv(" in path.read_text()]
    assert cpp == []  # C++ reads no environment at all: it is handed what it needs


def launch_record():
    return _launch.record()


def test_every_rank_of_a_job_sees_its_launch():
    records = run_spawn(launch_record, 2, init=False, timeout=60)
    assert records == [_launch.Launch("env", True, r, 2, r, 2) for r in range(2)]


@pytest.mark.mpi
def test_every_rank_of_an_mpiexec_job_sees_its_launch():
    records = run_mpiexec(launch_record, 2, init=False, timeout=60)
    assert records == [_launch.Launch("mpiexec", True, r, 2, r, 2) for r in range(2)]
