"""run_spawn checks how every rank ends, not only what it returned: a rank that crashes or hangs after its
result fails the run, naming the rank; a rank meant to die (may_exit) does not."""
import atexit
import os
import time

import pytest
import torch.distributed as dist

from tests.support.harness import RankFailure, run_spawn


def _then(end: str):
    """After the interpreter's shutdown begins (the result written, the group destroyed): end as told."""
    if end == "exit 3":
        os._exit(3)
    elif end == "abort":
        os.abort()
    elif end == "hang":
        time.sleep(3600)


def return_then_end(end: str):
    if dist.get_rank() == 1:
        atexit.register(_then, end)
    return "ok"


@pytest.mark.parametrize("end,said", [("exit 3", "exit code 3"), ("abort", "killed by SIGABRT"),
                                      ("hang", "still running after")])
def test_a_rank_that_ends_badly_after_its_result_fails_the_run(end, said):
    with pytest.raises(RankFailure) as info:
        run_spawn(return_then_end, 2, end, timeout=20 if end == "hang" else 60)
    message = str(info.value)
    assert f"rank 1 returned its result, then ended badly: {said}" in message, message
    assert "rank 0 returned" not in message, message


def dies_after_a_barrier():
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(5)
    return "survived"


def test_a_rank_meant_to_die_does_not_fail_the_run_and_its_survivor_ends_cleanly():
    assert run_spawn(dies_after_a_barrier, 2, may_exit=(1,), timeout=60) == ["survived", None]
