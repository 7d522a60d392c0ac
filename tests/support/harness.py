"""Run a function on N real processes joined by the chainermn backend, and collect what each returns.

Three launchers, all with real processes:
- `run_spawn`: multiprocessing's processes (forks of a forkserver) with env:// rendezvous, as torchrun does
  (transport: Gloo);
- `run_mpiexec`: Open MPI's mpiexec with no rendezvous variables at all (transport: MPI);
- `run_srun`: Slurm's srun (or sbatch), likewise with none (see tests/support/slurm_cluster.py).

`fn(*args)` runs on every rank after `dist.init_process_group("chainermn")`; its return values come
back as a list indexed by rank. A rank that raises makes the run fail with that rank's traceback. A
run that outlives `timeout` is killed, so a hang fails the test instead of stalling the suite.

Every rank's end is checked, not only its result: a rank that returns and then crashes (a signal, a
non-zero exit) or hangs in the teardown (the closing barrier, destroy_process_group, the interpreter's
shutdown) fails the run, naming the rank and how it ended. A test that means ranks to die names them and
their end in `dies` ({1: "exit code 0"}, {2: "killed by SIGKILL"}): each must end that way before the
deadline without returning (neither a result nor an exception), and the survivors' teardown then passes
a closing barrier that fails on the broken group (it still destroys the group and must end cleanly). A
survivor whose default group broke (a dead or departed peer, an abort, a timeout) fails the run unless
the test declared a death or said the group may break (`group_may_break=True`).

`run_job` runs any command line that way (a launcher and the ranks it starts), for tests that check
what a whole job does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MPIEXEC = shutil.which("mpiexec")


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds their tracebacks."""


def cached_launch(launch):
    """functools.cache for a function that launches a job shared by many test IDs, caching a failure too:
    the first ID that needs the job runs it, and every later one gets its result or raises its error again
    (a hung launch costs its timeout once, not once per ID)."""
    outcomes = {}

    @functools.wraps(launch)
    def cached(*args):
        if args not in outcomes:
            try:
                outcomes[args] = (True, launch(*args))
            except Exception as error:  # noqa: BLE001  raised again to every ID that needs this launch
                outcomes[args] = (False, error)
        succeeded, value = outcomes[args]
        if not succeeded:
            raise RankFailure(
                f"the shared launch {launch.__name__}{args} failed (reported once per test that needs it):\n{value}"
            ) from value
        return value

    return cached


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int) -> list:
    """torchrun on this machine with `nproc` ranks and a store on a free port: append the script."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
    ]


def _reference(fn) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def _resolve(reference: str):
    module, _, name = reference.partition(":")
    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def rank_main(
    reference: str, args_path: str, out_dir: str, init: bool, timeout_s: float, group_may_break: bool = False
) -> None:
    """Body of every rank: init, run, write the result (or the traceback) to out_dir/<rank>.pkl, then leave
    together. `group_may_break`: the test means some ranks to die or the default group to break, so a
    broken default group is no failure and the closing barrier may fail."""
    import datetime

    import torch.distributed as dist

    import torch_chainermn  # noqa: F401  registers the backend (and reads MPI's ranks under mpiexec)

    rank = int(os.environ["RANK"])
    outcome = {}
    try:
        with open(args_path, "rb") as f:
            args, kwargs = pickle.load(f)
        if init:
            dist.init_process_group("chainermn", timeout=datetime.timedelta(seconds=timeout_s))
        outcome["value"] = _resolve(reference)(*args, **kwargs)
    except BaseException:  # noqa: BLE001  report everything to the parent
        outcome["error"] = traceback.format_exc()
    if "error" not in outcome and not group_may_break and dist.is_initialized():
        broken = _broken_reason()
        if broken:  # nobody was meant to die and nothing was meant to break it: the run must say so
            outcome["error"] = (
                f"the default group broke: {broken}\n(a test that means it to break declares "
                f"the death in run_spawn's dies=, or passes group_may_break=True)"
            )
    tmp = Path(out_dir) / f".{rank}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    tmp.rename(Path(out_dir) / f"{rank}.pkl")
    if dist.is_initialized() and "error" not in outcome:
        # Rank 0 hosts the store: it must not leave while others may still use it. A group the test saw
        # break (a dead or departed peer, an abort: its ops fail from then on) has no closing barrier.
        try:
            if not _broken_reason():
                dist.barrier()
        except Exception:  # noqa: BLE001
            if not group_may_break:  # nobody was meant to die: the group broke, and the run must say so
                raise
        finally:
            dist.destroy_process_group()


def _broken_reason() -> str:
    """Why the default group, on chainermn, is unusable after a failure ("" while it is usable)."""
    import torch_chainermn

    try:
        backend = torch_chainermn._backend.backend_of()
    except ValueError:  # another backend (a test of torch's own)
        return ""
    return backend.broken_reason()


def _spawn_target(reference, args_path, out_dir, init, timeout_s, group_may_break, env, output):
    import faulthandler

    output.restore()
    # A rank that dies of a signal says where: Python's stacks of every thread, and with
    # CHAINERMN_TEST_CPP_STACKS=1 torch's C++ stacks too (the first GPU runs: a crash leaves no result).
    faulthandler.enable(all_threads=True)
    os.environ.update(env)
    import torch.distributed as dist

    dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG: read at import, in the forkserver (below)
    if os.environ.get("CHAINERMN_TEST_CPP_STACKS") == "1":
        import torch

        torch._C._set_print_stack_traces_on_fatal_signal(True)
    rank_main(reference, args_path, out_dir, init, timeout_s, group_may_break)


def _forked_target(*args):
    """_spawn_target in a forkserver's child, then the end of a spawned rank: the interpreter's shutdown
    (its threads joined, atexit hooks, modules freed: most of a second here) and exit(). A forkserver's child
    would end with os._exit at once, and tests that time a peer's last moments would see it sooner."""
    import ctypes

    _spawn_target(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.pythonapi.Py_Exit(0)  # what `sys.exit(0)` at a spawned rank's top level ends in


class _TestOutput:
    """This process's stdout and stderr (fds 1 and 2) as they are when a rank starts, for the rank: pytest
    points them at the running test's capture, and a forkserver's child would have the server's."""

    def __init__(self, fds=None):
        self.fds = fds

    def __reduce__(self):
        from multiprocessing.reduction import DupFd  # passed to the child as fds, like a Connection

        return _TestOutput, ((DupFd(1), DupFd(2)),)

    def restore(self):
        for target, fd in enumerate((dup.detach() for dup in self.fds), start=1):
            if fd != target:  # spawn's child has them as fds 1 and 2 already
                os.dup2(fd, target)
                os.close(fd)


# run_spawn's ranks are forks of one forkserver that has imported torch, torch.distributed and torch_chainermn
# once: under plain "spawn" each rank spent ~3.5 s of CPU importing them, most of a small job's time on a
# 2-core machine. Whatever those imports read from the environment is read in the server, which has the
# test process's environment with a rank's OMP_NUM_THREADS and no launcher's variables (so that importing
# torch_chainermn neither calls MPI_Init nor takes a launcher's ranks). What a rank's own environment must
# decide is read again in the rank: torch_chainermn's launcher record when RANK is set (_launch.record()),
# TORCH_DISTRIBUTED_DEBUG in _spawn_target; the group settings (CHAINERMN_SHM, ...) are read at init.
# IMPORT_TIME_VARIABLES are read at import alone: a call that gives one of them another value than the
# server has starts its ranks with plain "spawn" instead. A forkserver's child would end with os._exit:
# _forked_target ends it as a spawned rank ends, with the interpreter's shutdown.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch_chainermn"]
IMPORT_TIME_VARIABLES = (
    "OMP_NUM_THREADS",  # by libgomp, when torch loads it
    "CHAINERMN_FORCE_ABORT_ON_EXCEPTION",
    "CHAINERMN_FORCE_ABORT_ON_EXCEPTIONS",  # torch_chainermn's except hook
)
_forkserver_env: dict | None = None


@contextlib.contextmanager
def _environment(env: dict):
    """os.environ is `env` inside (only the variables that differ are touched), as it was after."""
    changed = {k: os.environ.get(k) for k in set(os.environ) | set(env) if os.environ.get(k) != env.get(k)}
    try:
        for k in changed:
            os.environ.pop(k) if env.get(k) is None else os.environ.__setitem__(k, env[k])
        yield
    finally:
        for k, v in changed.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _rank_context(rank_envs: list):
    """The forkserver context (started, with the preload, in its environment on first use), or plain
    spawn for ranks that set an IMPORT_TIME_VARIABLES differently."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    global _forkserver_env
    if _forkserver_env is None:
        _forkserver_env = launcher_free_environment(drop_prefixes=("OMPI_", "PMIX_", "PMI_"))
        _forkserver_env.update(_base_env(None))
        forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)
    if any(env.get(k) != _forkserver_env.get(k) for env in rank_envs for k in IMPORT_TIME_VARIABLES):
        return mp.get_context("spawn")
    with _environment(_forkserver_env):  # (re)starts it if it is not running
        forkserver.ensure_running()
    return mp.get_context("forkserver")


def _exit_description(code) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _outcomes(out_dir: Path, world_size: int) -> list:
    """What each rank wrote: {"value": ...} or {"error": traceback}, or None where it wrote nothing."""
    outcomes = []
    for rank in range(world_size):
        path = out_dir / f"{rank}.pkl"
        if path.exists():
            with open(path, "rb") as f:
                outcomes.append(pickle.load(f))
        else:
            outcomes.append(None)
    return outcomes


def _collect(out_dir: Path, world_size: int, how: str) -> list:
    """Every rank's result; RankFailure naming each rank that raised or wrote none (`how`: how the job ended)."""
    outcomes = _outcomes(out_dir, world_size)
    errors = [
        f"rank {rank}: no result ({how})" if outcome is None else f"rank {rank} raised:\n{outcome['error']}"
        for rank, outcome in enumerate(outcomes)
        if outcome is None or "error" in outcome
    ]
    if errors:
        raise RankFailure("\n".join(errors))
    return [outcome["value"] for outcome in outcomes]


def _write_args(tmp: Path, args, kwargs) -> str:
    path = tmp / "args.pkl"
    with open(path, "wb") as f:
        pickle.dump((args, kwargs), f)
    return str(path)


RENDEZVOUS_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def launcher_free_environment(drop_prefixes: tuple = ()) -> dict:
    """This process's environment without the rendezvous variables, Slurm's (a suite run inside a Slurm
    job would hand its task's to every job) and any `drop_prefixes`, so a job started from a test takes
    its ranks from its own launcher, not from this one."""
    drop = ("SLURM_",) + tuple(drop_prefixes)
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES and not k.startswith(drop)}


def _base_env(extra: dict | None) -> dict:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def job_environment(extra: dict | None = None) -> dict:
    """The environment of a job a test launches: no rendezvous variables, this checkout first on
    PYTHONPATH, one OpenMP thread per process, then `extra`."""
    env = launcher_free_environment()
    env.update(_base_env(extra))
    return env


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc, whatever session they are in."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def launch(
    command: list, env: dict, timeout: float = 300.0, cwd=REPO, what: str = "the job", merged: bool = False
) -> subprocess.CompletedProcess:
    """Run `command` in a session of its own, its output captured as text (stdout and stderr apart,
    or `merged` into stdout).

    A job still running after `timeout` seconds is killed with every process it started (a launcher's
    ranks too, through the session) and raises RankFailure with the end of its output: a hang fails.
    """
    # stdin from /dev/null: a job never reads the test's input, and mpiexec then forwards none to
    # rank 0 (its forwarding of an open stdin is one more thing that can keep it alive at the end).
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: killing the launcher's session alone would
        # leave them holding the output pipe open, and communicate() would wait for them forever.
        for pid in [proc.pid] + _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL) if pid == proc.pid else os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RankFailure(
            f"{what} was still running after {timeout:.0f} s and was killed. Output:\n{(out + (err or ''))[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err or "")


def run_job(command: list, env: dict, timeout: float, cwd=REPO, what: str = "the job") -> tuple[int, str]:
    """launch() with stdout and stderr as one output: (exit status, output)."""
    result = launch(command, env, timeout, cwd, what, merged=True)
    return result.returncode, result.stdout


def run_spawn(
    fn,
    world_size: int,
    *args,
    env=None,
    rank_env=None,
    timeout=120.0,
    op_timeout=60.0,
    init=True,
    dies=None,
    group_may_break=False,
    **kwargs,
) -> list:
    """Run fn on world_size new processes (env:// rendezvous, Gloo transport).

    `dies`: {rank: how it must end} for the ranks the test means to die, as the harness describes an end
    ("exit code 0", "killed by SIGKILL"): each must end so before `timeout`, without returning (neither
    a result nor an exception); its place in the results is None. Every other rank must end cleanly
    (exit 0) within `timeout`, its result written. `group_may_break`: the test means the default group to
    break though no rank dies (a peer that leaves it on purpose, an abort); with `dies` it may break too.
    """
    dies = dict(dies or {})
    port = free_port()
    # Each rank's whole environment: a forkserver's child starts from the server's, not from ours.
    rank_envs = [
        {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            **_base_env(env),
            **((rank_env or {}).get(rank, {})),
        }
        for rank in range(world_size)
    ]
    ctx = _rank_context(rank_envs)
    with tempfile.TemporaryDirectory(prefix="chainermn-test-") as tmp_name:
        tmp = Path(tmp_name)
        args_path = _write_args(tmp, args, kwargs)
        procs = []
        for rank_vars in rank_envs:
            p = ctx.Process(
                target=_forked_target if ctx.get_start_method() == "forkserver" else _spawn_target,
                args=(
                    _reference(fn),
                    args_path,
                    str(tmp),
                    init,
                    op_timeout,
                    bool(dies) or group_may_break,
                    rank_vars,
                    _TestOutput(),
                ),
            )
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        ends = {
            rank: f"still running after {timeout:.0f} s, killed" if rank in hung else _exit_description(p.exitcode)
            for rank, p in enumerate(procs)
        }
        how = ", ".join(f"rank {rank} {end}" for rank, end in ends.items())
        outcomes = _outcomes(tmp, world_size)
        problems = []
        for rank, outcome in enumerate(outcomes):
            if rank in dies:
                meant = f"rank {rank} was meant to die ({dies[rank]})"
                if outcome is not None and "error" in outcome:
                    problems.append(f"{meant} but raised:\n{outcome['error']}")
                elif outcome is not None:
                    problems.append(f"{meant} but returned its result, then ended: {ends[rank]}")
                elif ends[rank] != dies[rank]:
                    problems.append(
                        f"{meant} but was {ends[rank]}" if rank in hung else f"{meant} but ended: {ends[rank]}"
                    )
            elif outcome is None:
                problems.append(f"rank {rank}: no result ({how})")
            elif "error" in outcome:
                problems.append(f"rank {rank} raised:\n{outcome['error']}")
            elif rank in hung or procs[rank].exitcode != 0:
                problems.append(f"rank {rank} returned its result, then ended badly: {ends[rank]}")
        if problems:
            raise RankFailure(
                "\n".join(problems) + "\n(a rank meant to die goes in dies=, with its end; see "
                "tests/support/harness.py)"
            )
        return [None if outcome is None else outcome["value"] for outcome in outcomes]


def run_mpiexec(
    fn, world_size: int, *args, env=None, timeout=180.0, op_timeout=60.0, init=True, allow_abnormal_exit=False, **kwargs
) -> list:
    """Run fn under `mpiexec -n world_size` with no rendezvous variables (MPI transport)."""
    if MPIEXEC is None:
        raise RuntimeError("mpiexec is not installed (make install sets up Open MPI)")
    with tempfile.TemporaryDirectory(prefix="chainermn-test-") as tmp_name:
        tmp = Path(tmp_name)
        args_path = _write_args(tmp, args, kwargs)
        command = [
            MPIEXEC,
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            str(world_size),
            sys.executable,
            "-m",
            "tests.support.harness",
            _reference(fn),
            args_path,
            str(tmp),
            "1" if init else "0",
            str(op_timeout),
        ]
        returncode, text = run_job(command, job_environment(env), timeout, what="mpiexec")
        results = _collect(tmp, world_size, f"mpiexec exited with {returncode}:\n{text[-4000:]}")
        if returncode != 0 and not allow_abnormal_exit:
            raise RankFailure(f"mpiexec exited with {returncode}:\n{text[-4000:]}")
        return results


def _run_batch_job(sbatch: list, env: dict, timeout: float, output: Path) -> tuple[int, str]:
    """Submit a batch job and wait for its end: (the batch script's exit status, its output). Polls
    every 0.2 s (sbatch --wait polls every few seconds, which is most of a short job's time)."""
    returncode, text = run_job(sbatch, env, 30, what="sbatch")
    if returncode != 0:
        raise RankFailure(f"sbatch failed with {returncode}:\n{text}")
    job = text.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while True:
        state = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
        fields = dict(f.split("=", 1) for f in state.split() if "=" in f)
        if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            log = output.read_text() if output.exists() else ""
            return int(fields.get("ExitCode", "1:0").split(":")[0]), f"{state}\n{log}"
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            raise RankFailure(f"Slurm job {job} was still running after {timeout:.0f} s and was cancelled:\n{state}")
        time.sleep(0.2)


def run_srun(
    fn,
    world_size: int,
    *args,
    slurm_conf: str,
    srun_args=(),
    batch=False,
    env=None,
    timeout=120.0,
    op_timeout=60.0,
    **kwargs,
) -> list:
    """Run fn under Slurm's `srun -n world_size` with no rendezvous variables: `import torch_chainermn`
    reads rank, size and the store's address from srun's SLURM_* variables.

    `slurm_conf`: the cluster's configuration (tests/support/slurm_cluster.py); `srun_args`: more of srun's
    options (--mpi=pmix); `batch`: submit a batch script that runs that srun (sbatch) instead."""
    with tempfile.TemporaryDirectory(prefix="chainermn-test-") as tmp_name:
        tmp = Path(tmp_name)
        args_path = _write_args(tmp, args, kwargs)
        rank_command = [
            sys.executable,
            "-m",
            "tests.support.harness",
            _reference(fn),
            args_path,
            str(tmp),
            "1",
            str(op_timeout),
        ]
        # A rank that fails ends the step (srun's default waits for the others).
        srun = ["srun", "-n", str(world_size), "--kill-on-bad-exit=1", *srun_args, *rank_command]
        env = job_environment({"SLURM_CONF": slurm_conf, **(env or {})})
        if batch:
            script = tmp / "job.sh"
            script.write_text("#!/bin/sh\nexec " + " ".join(srun) + "\n")
            returncode, text = _run_batch_job(
                ["sbatch", "--parsable", "-n", str(world_size), "-o", str(tmp / "job.out"), str(script)],
                env,
                timeout,
                tmp / "job.out",
            )
        else:
            returncode, text = run_job(srun, env, timeout, what="srun")
        results = _collect(tmp, world_size, f"the Slurm job exited with {returncode}:\n{text[-4000:]}")
        if returncode != 0:
            raise RankFailure(f"the Slurm job exited with {returncode}:\n{text[-4000:]}")
        return results


if __name__ == "__main__":
    # Entry point of every rank under mpiexec and srun.
    reference, args_path, out_dir, init, op_timeout = sys.argv[1:6]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch_chainermn  # noqa: F401  sets RANK etc. from MPI or Slurm

    rank_main(reference, args_path, out_dir, init == "1", float(op_timeout))
