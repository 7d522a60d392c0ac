"""The global except hook: one rank's uncaught exception ends the whole job, under torchrun and mpiexec.

Each job runs a script where rank 1 raises while rank 0 waits in a collective whose group timeout is
far longer than the test allows: the subprocess timeout is the failure condition, so a job that
hangs fails the test.
"""

import os
import sys
import textwrap
import threading

import pytest

import torch_chainermn.global_except_hook as global_except_hook
from tests.support.harness import MPIEXEC, REPO, job_environment, run_job

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
JOB_TIMEOUT_S = 90  # generous for a loaded machine; the group timeout (600 s) is far beyond it

SCRIPT = textwrap.dedent("""
    import datetime, os, threading, time
    import torch
    import torch.distributed as dist
    import torch_chainermn
    import torch_chainermn.global_except_hook as global_except_hook

    if os.environ.get("CHAINERMN_FORCE_ABORT_ON_EXCEPTION"):
        global_except_hook._install_from_environment()   # what importing torch_chainermn does
    else:
        global_except_hook.add_hook()
    dist.init_process_group("chainermn", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 1:
        print("rank 1 about to fail")           # not flushed: the hook must flush it
        store.wait(["rank 0 enters its collective"])  # fail while rank 0 waits in it
        if os.environ.get("FAIL_IN_THREAD"):
            def work():
                raise RuntimeError("deliberate failure in a thread of rank 1")
            threading.Thread(target=work, name="loader").start()
            time.sleep(600)                      # the main thread lives on: the thread's failure must end it
        raise RuntimeError("deliberate failure on rank 1")
    store.set("rank 0 enters its collective", "1")
    if os.environ.get("WAIT_OP") == "all_reduce":
        dist.all_reduce(torch.ones(16))
    else:
        dist.barrier()
    time.sleep(600)                              # rank 0 must never get past its collective quietly: if it
                                                 # does, the job runs past JOB_TIMEOUT_S and fails
    print("rank 0 finished")
""")


def run_failing_job(tmp_path, command, env):
    """Run SCRIPT under `command`; (exit status, output). A hang, the failure this test exists to
    catch, fails the test once JOB_TIMEOUT_S has passed (the launcher and its ranks are killed)."""
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(SCRIPT)
    return run_job(command + [str(script)], job_environment(env), JOB_TIMEOUT_S, cwd=tmp_path)


def check_job_failed_with_report(returncode, output, what="deliberate failure on rank 1"):
    assert returncode != 0, output
    assert "chainermn: uncaught exception on rank 1 of 2" in output, output
    assert what in output and "Traceback (most recent call last)" in output, output
    assert "rank 1 about to fail" in output, output  # stdout flushed before the process ended
    assert "rank 0 finished" not in output, output


def test_torchrun_job_ends_when_one_rank_raises(tmp_path):
    # Rank 0 waits in a barrier over shared memory: it sees rank 1 gone, raises, and its hook ends it.
    returncode, output = run_failing_job(tmp_path, [TORCHRUN, "--nproc-per-node", "2"], {"CHAINERMN_SHM": "1"})
    check_job_failed_with_report(returncode, output)


def test_torchrun_job_ends_when_a_thread_raises_over_gloo(tmp_path):
    # Over Gloo's sockets: the dead rank's closed connections make rank 0's all_reduce fail.
    returncode, output = run_failing_job(
        tmp_path,
        [TORCHRUN, "--nproc-per-node", "2"],
        {"CHAINERMN_SHM": "0", "FAIL_IN_THREAD": "1", "WAIT_OP": "all_reduce"},
    )
    check_job_failed_with_report(returncode, output, "deliberate failure in a thread of rank 1")
    assert "rank 1 of 2 (thread loader)" in output, output


@pytest.mark.mpi
def test_mpiexec_job_is_aborted_when_one_rank_raises(tmp_path):
    # Without shared memory rank 0 blocks in an MPI barrier that only MPI_Abort can end.
    # The hook is installed from CHAINERMN_FORCE_ABORT_ON_EXCEPTION, as a user of ChainerMN would.
    # Without mpiexec this fails, as every other MPI test does (make install sets up Open MPI).
    assert MPIEXEC is not None, "mpiexec is not installed (make install sets up Open MPI)"
    returncode, output = run_failing_job(
        tmp_path,
        [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable],
        {"CHAINERMN_SHM": "0", "CHAINERMN_FORCE_ABORT_ON_EXCEPTION": "1"},
    )
    check_job_failed_with_report(returncode, output)
    assert "chainermn: rank 1 calls MPI_Abort to end all 2 ranks" in output, output


def test_add_and_remove_hook_restore_previous_hooks(monkeypatch):
    def mine(*args):
        pass

    monkeypatch.setattr(sys, "excepthook", mine)
    monkeypatch.setattr(threading, "excepthook", mine)
    global_except_hook.add_hook()
    global_except_hook.add_hook()  # idempotent: the previous hook is still `mine`
    assert global_except_hook.hook_installed()
    global_except_hook.remove_hook()
    assert sys.excepthook is mine and threading.excepthook is mine
    assert not global_except_hook.hook_installed()
    global_except_hook.remove_hook()  # a no-op now
    assert sys.excepthook is mine

    for value, installed in [("", False), ("0", False), ("1", True), ("yes", True)]:
        monkeypatch.setenv("CHAINERMN_FORCE_ABORT_ON_EXCEPTION", value)
        monkeypatch.delenv("CHAINERMN_FORCE_ABORT_ON_EXCEPTIONS", raising=False)
        assert global_except_hook._install_from_environment() is installed
        assert global_except_hook.hook_installed() is installed
        global_except_hook.remove_hook()
    monkeypatch.delenv("CHAINERMN_FORCE_ABORT_ON_EXCEPTION")
    monkeypatch.setenv("CHAINERMN_FORCE_ABORT_ON_EXCEPTIONS", "1")  # the manual's other spelling
    assert global_except_hook._install_from_environment()
    global_except_hook.remove_hook()
    assert sys.excepthook is mine


def test_hook_in_a_process_without_torch_distributed():
    # No process group: the rank comes from the environment, and a thread's SystemExit is no failure.
    code = textwrap.dedent("""
        import sys, threading
        import torch_chainermn.global_except_hook as h
        h.add_hook()
        t = threading.Thread(target=sys.exit); t.start(); t.join()
        print("still alive after a thread's SystemExit")
        try:
            import atexit; atexit.register(lambda: print("atexit ran"))
        finally:
            raise ValueError("boom")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "3", "WORLD_SIZE": "4"}
    returncode, output = run_job([sys.executable, "-c", code], env, JOB_TIMEOUT_S)
    assert returncode == global_except_hook.EXIT_CODE, output
    assert "still alive after a thread's SystemExit" in output, output
    assert "chainermn: uncaught exception on rank 3 of 4:" in output and "ValueError: boom" in output, output
    assert "atexit ran" not in output, output  # ended at once: no interpreter shutdown to hang in
