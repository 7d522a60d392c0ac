"""A real one-node Slurm cluster on this host for the tests: munged, slurmctld and slurmd, started in a
temporary directory with a configuration of their own (free ports, no cgroups, no accounting) and
stopped afterwards. Debian's slurmd, slurmctld and slurm-client (and munge) are what `make install`
sets up.

    with slurm_cluster(tmp_path) as env:      # env: this environment plus SLURM_CONF
        subprocess.run(["srun", "-n", "2", ...], env=env)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.support.harness import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
START_TIMEOUT_S = 30


def missing() -> str | None:
    """Why no cluster can be started here, or None."""
    absent = [
        p
        for p in DAEMONS + ("srun", "sbatch", "sinfo")
        if shutil.which(p) is None and not Path("/usr/sbin", p).exists()
    ]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): `make install` installs it as root"
    if os.getuid() != 0:
        return "slurmd must run as root to start tasks"
    return None


def _config(run: Path, host: str) -> str:
    return f"""\
ClusterName=chainermn-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={run}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={run}/state
SlurmdSpoolDir={run}/spool
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd.pid
SlurmctldLogFile={run}/slurmctld.log
SlurmdLogFile={run}/slurmd.log
# No cgroups, no accounting, no MPI by default: nothing this host need provide.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# More CPUs than this VM has, so tests may start more tasks than cores (slurmd believes the file).
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@contextlib.contextmanager
def slurm_cluster(directory: Path):
    why_not = missing()
    if why_not:
        raise RuntimeError(why_not)
    run = Path(directory) / "slurm"
    for sub in ("state", "spool"):
        (run / sub).mkdir(parents=True)
    run.chmod(0o700)  # munged refuses a key in a directory others can write
    key = run / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = run / "slurm.conf"
    conf.write_text(_config(run, host))
    env = dict(os.environ, SLURM_CONF=str(conf))

    daemons = []
    try:
        # Each in the foreground, so that it is our child and we stop exactly it.
        daemons.append(
            subprocess.Popen(
                [
                    _sbin("munged"),
                    "--foreground",
                    "--force",
                    f"--socket={run}/munge.socket",
                    f"--key-file={key}",
                    f"--pid-file={run}/munged.pid",
                    f"--log-file={run}/munged.log",
                    f"--seed-file={run}/munged.seed",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        while not (run / "munge.socket").exists():
            _check_alive(daemons, run)
            time.sleep(0.05)
        daemons.append(
            subprocess.Popen(
                [_sbin("slurmctld"), "-D", "-i"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
        )
        daemons.append(
            subprocess.Popen(
                [_sbin("slurmd"), "-D", "-N", host], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            _check_alive(daemons, run)
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Slurm node is not idle after {START_TIMEOUT_S} s ({state.stdout.strip()}"
                    f"{state.stderr.strip()}):\n{_logs(run)}"
                )
            time.sleep(0.2)
        yield env
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def _check_alive(daemons: list, run: Path) -> None:
    for daemon in daemons:
        if daemon.poll() is not None:
            raise RuntimeError(f"{Path(daemon.args[0]).name} exited with {daemon.returncode}:\n{_logs(run)}")


def _logs(run: Path) -> str:
    return "\n".join(f"{log.name}:\n{log.read_text()[-2000:]}" for log in sorted(run.glob("*.log")))
