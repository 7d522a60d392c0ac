"""A script that ends with operations still queued or running exits cleanly: its operations finish
(peers are not left waiting for them), their callbacks run, and the process does not abort.

The hazard: the worker thread drops the last reference to a tensor whose Python object is gone, which
needs the GIL; during interpreter finalisation a thread asking for the GIL is killed by forced
unwinding, and that aborts the process ("terminate called without an active exception")."""

import subprocess
import sys
import textwrap

from tests.support.harness import REPO, free_port, launcher_free_environment, run_job

OPS = 24

SCRIPT = textwrap.dedent(f"""
    import sys
    import torch
    import torch.distributed as dist
    import torch_chainermn

    dist.init_process_group("chainermn")
    log = open(sys.argv[1] + f".{{dist.get_rank()}}", "w", buffering=1)

    def finished(future):
        log.write(f"{{float(future.value()[0][0])}}\\n")

    for _ in range({OPS}):
        # 16 MiB each, created here and dropped at once: only the queued op holds the tensor.
        work = dist.all_reduce(torch.ones(1 << 22), async_op=True)
        work.get_future().then(finished)
    del work
    # No wait, no destroy_process_group: the interpreter exits with the queue full.
""")


def test_exit_with_operations_in_flight(tmp_path):
    script, log = tmp_path / "exit_early.py", tmp_path / "finished"
    script.write_text(SCRIPT)
    env = launcher_free_environment(drop_prefixes=("CHAINERMN_",))
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(script),
        str(log),
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    report = f"exit status {result.returncode}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert "terminate called" not in result.stderr, report
    for rank in (0, 1):
        sums = (tmp_path / f"finished.{rank}").read_text().split()
        assert sums == ["2.0"] * OPS, report


RELEASE_SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    import torch_chainermn

    dist.init_process_group("chainermn")
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group(backend="chainermn")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
    if rank == 1:  # rank 0's op waits for this one while rank 0 lets go of the group
        store.wait(["rank 0 lets go of the group"])
    dist.all_reduce(torch.ones(1 << 20), group=group, async_op=True)  # only the op holds the tensor
    if rank == 0:
        store.set("rank 0 lets go of the group", "1")
    dist.destroy_process_group(group)
    del group
    del model  # the DDP Reducer held the last reference: the group's threads are joined here
    print(f"rank {rank} released", flush=True)
    dist.destroy_process_group()
""")


def test_a_group_released_by_ddp_while_its_op_finishes(tmp_path):
    """The interpreter frees a DDP Reducer holding a group's last reference (with the GIL held) while
    the group's worker finishes an op whose tensor only the op holds: freeing that tensor needs the
    GIL. Joining the worker with the GIL held hung rank 0 for ever (4 runs of 4 before the fix)."""
    script = tmp_path / "release.py"
    script.write_text(RELEASE_SCRIPT)
    env = launcher_free_environment(drop_prefixes=("CHAINERMN_",))
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(script),
    ]
    status, output = run_job(command, env, timeout=90)  # a hang fails (RankFailure), its ranks killed
    assert status == 0, output[-4000:]
    assert "rank 0 released" in output and "rank 1 released" in output, output[-4000:]


def test_a_terminate_names_its_thread():
    """std::terminate on one of the backend's threads (at exit, the ones above) prints the thread's name
    and its native stack before the process aborts, not only libstdc++'s "terminate called"."""
    code = "import torch_chainermn._C as C; C.testing.terminate_on_thread('cmn-probe')"
    env = launcher_free_environment(drop_prefixes=("CHAINERMN_",))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -6, result.stderr[-3000:]  # SIGABRT, as before the report
    assert "chainermn: std::terminate on thread cmn-probe (no exception" in result.stderr, result.stderr[-3000:]
    assert "terminate called without an active exception" in result.stderr, result.stderr[-3000:]
