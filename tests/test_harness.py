"""run_spawn checks how every rank ends, not only what it returned: a rank that crashes or hangs after its
result, or that never writes one, fails the run, naming the rank; a rank meant to die (`dies`) must die,
before the deadline and as declared; a default group that breaks fails the run unless the test said so.

Most cases need no process group (init=False): what is checked is the rank's end, which the harness
sees the same way with or without one."""

import atexit
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import RankFailure, run_spawn


def _then(end: str):
    """After the interpreter's shutdown begins (the result written, the group destroyed): end as told."""
    if end == "exit 3":
        os._exit(3)
    elif end == "abort":
        os.abort()
    elif end == "hang":
        time.sleep(3600)  # a hang, which the harness must kill at its deadline


def return_then_end(end: str):
    if dist.get_rank() == 1:
        atexit.register(_then, end)
    return "ok"


@pytest.mark.parametrize(
    "end,said", [("exit 3", "exit code 3"), ("abort", "killed by SIGABRT"), ("hang", "still running after")]
)
def test_a_rank_that_ends_badly_after_its_result_fails_the_run(end, said):
    with pytest.raises(RankFailure) as info:
        run_spawn(return_then_end, 2, end, timeout=20 if end == "hang" else 60)
    message = str(info.value)
    assert f"rank 1 returned its result, then ended badly: {said}" in message, message
    assert "rank 0 returned" not in message, message


def rank_one_does(what: str):
    """Rank 0 returns; rank 1 does `what` instead of (or before) returning. No process group."""
    if os.environ["RANK"] == "1":
        if what == "exit 3":
            os._exit(3)
        elif what == "exit 0":
            os._exit(0)
        elif what == "hang":
            time.sleep(3600)  # a hang, which the harness must kill at its deadline
        elif what == "raise":
            raise RuntimeError("rank 1 raised instead of dying")
    return "ok"


def test_a_rank_that_writes_no_result_fails_the_run():
    with pytest.raises(RankFailure) as info:
        run_spawn(rank_one_does, 2, "exit 3", init=False, timeout=60)
    message = str(info.value)
    assert "rank 1: no result (rank 0 exit code 0, rank 1 exit code 3)" in message, message
    assert "rank 0:" not in message, message


@pytest.mark.parametrize(
    "what,declared,said",
    [
        ("hang", "exit code 0", "rank 1 was meant to die (exit code 0) but was still running after 10 s, killed"),
        (
            "return",
            "exit code 0",
            "rank 1 was meant to die (exit code 0) but returned its result, then ended: exit code 0",
        ),
        ("raise", "exit code 0", "rank 1 was meant to die (exit code 0) but raised:"),
        ("exit 3", "killed by SIGKILL", "rank 1 was meant to die (killed by SIGKILL) but ended: exit code 3"),
    ],
    ids=["hangs", "returns", "raises", "ends-otherwise"],
)
def test_a_rank_meant_to_die_that_does_not_die_as_declared_fails_the_run(what, declared, said):
    with pytest.raises(RankFailure) as info:
        run_spawn(rank_one_does, 2, what, init=False, dies={1: declared}, timeout=10 if what == "hang" else 60)
    message = str(info.value)
    assert said in message, message
    assert "rank 0" not in message.split("\n(a rank meant")[0], message  # rank 0 ended as it should


def test_a_rank_that_dies_as_declared_passes():
    assert run_spawn(rank_one_does, 2, "exit 0", init=False, dies={1: "exit code 0"}, timeout=60) == ["ok", None]


def dies_after_a_barrier():
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(5)
    return "survived"


def test_a_rank_meant_to_die_does_not_fail_the_run_and_its_survivor_ends_cleanly():
    assert run_spawn(dies_after_a_barrier, 2, dies={1: "exit code 5"}, timeout=60) == ["survived", None]


def leaves_the_default_group():
    """Rank 1 leaves the default group on purpose (nobody dies) and returns; rank 0's next op fails
    naming it, and rank 0's group is broken from then on."""
    dist.barrier()
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        return "left"
    try:
        dist.all_reduce(torch.ones(4))
    except dist.DistBackendError as error:
        return str(error)
    return "completed"


def test_a_default_group_that_breaks_fails_the_run_unless_the_test_says_it_may():
    # Every rank ends cleanly here (rank 1 has no group left to close): only the break can fail the run.
    with pytest.raises(RankFailure) as info:
        run_spawn(leaves_the_default_group, 2, timeout=60, op_timeout=30)
    message = str(info.value)
    assert "rank 0 raised:" in message and "the default group broke" in message, message
    assert not any(line.startswith("rank 1") for line in message.splitlines()), message  # rank 1 ended well
    said, left = run_spawn(leaves_the_default_group, 2, group_may_break=True, timeout=60, op_timeout=30)
    assert "rank 1 (host" in said and "exited" in said and left == "left", said
