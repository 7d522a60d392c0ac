"""torch_chainermn.torchft: torchft's reconfigurable process groups on chainermn (torchft is installed
for the tests by `make install`): a quorum's group works, a new quorum rebuilds it, a replica that
torchft aborts is named on its peers at once, and a replica SIGKILLed under torchft's Manager and
restarted rejoins with the survivor's weights. torchft's own tests (its Manager's DDP, LocalSGD,
DiLoCo, the baby groups) run on chainermn in tests/test_torchft_upstream.py."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.support.harness import run_spawn


def replica_groups():
    """Each rank a replica: two quorums' groups (torchft's configure, as its Manager calls it on each
    quorum), an all_reduce in each; then replica 1 aborts (torchft's way to end a failed replica's
    group) while replica 0 waits in an all_reduce."""
    import torch_chainermn.torchft as ft

    rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    pg = ft.ProcessGroupChainerMN(timeout=timedelta(seconds=30))
    sums = []
    for quorum in (1, 2):
        pg.configure(f"127.0.0.1:{port}/torchft/{quorum}", f"replica_{rank}", rank, 2)
        value = torch.full((100,), float(rank + 1))
        pg.allreduce([value], dist.ReduceOp.SUM).wait()
        sums.append(value[0].item())
    outcome = {"sums": sums, "name": pg.getBackendName(), "errored before": pg.errored()}
    if rank == 1:
        store.wait(["rank 0's allreduce posted"])  # rank 0 now waits for rank 1 in it
        pg.abort()
        store.wait(["rank 0 has its error"])  # alive until then: rank 0 must learn of the abort, not a death
    else:
        try:
            work = pg.allreduce([torch.ones(10)], dist.ReduceOp.SUM)
            store.set("rank 0's allreduce posted", "1")
            work.wait()
            outcome["after abort"] = "completed"
        except Exception as error:  # noqa: BLE001  torchft passes the backend's error on
            outcome["after abort"] = str(error)
        outcome["errored after"] = str(pg.errored())
        store.set("rank 0 has its error", "1")
    return outcome


def test_torchft_process_groups_on_chainermn():
    """ProcessGroupChainerMN: two quorums, each all_reduce right; replica 1's abort fails replica 0's
    pending all_reduce with the abort's reason (its timeout is 30 s), and errored() then says it
    (None before). ProcessGroupBabyChainerMN runs torchft's own cases (tests/test_torchft_upstream.py)."""
    outcomes = run_spawn(replica_groups, 2, init=False, timeout=120)
    for outcome in outcomes:
        assert outcome["sums"] == [3.0, 3.0] and outcome["name"] == "torchft-chainermn", outcome
    said = "rank 1 aborted the group (ProcessGroup.abort())"
    assert said in outcomes[0]["after abort"] and said in outcomes[0]["errored after"], outcomes[0]
    assert outcomes[0]["errored before"] is None and outcomes[1]["errored before"] is None, outcomes


def test_torchft_replica_killed_and_restarted_on_chainermn(tmp_path):
    """A real kill: 2 replica groups of 2 ranks (tests/support/torchft_replicas.py: each replica group
    has its own chainermn group, and torchft's ProcessGroupChainerMN joins rank r of both replicas;
    all of them on this machine, through shared memory), torchft's Manager, DDP and OptimizerWrapper,
    a lighthouse with min_replicas=1 (heartbeat timeout 2 s). Replica 1's two processes are SIGKILLed
    from outside in the middle of a step (held after its forward, so that replica 0 waits for it in
    that step's allreduce); replica 0's step fails and does not commit, and it trains on alone;
    replica 1 is started again (new processes, same replica id), fetches the weights and optimizer
    state from replica 0 and rejoins; both stop 3 steps later.

    Every rank of both replicas ends with the same parameters, bit for bit, and they are those of a
    plain replay of the committed steps (no step lost or applied twice, the optimizer state fetched
    too); replica 0's step count advanced while replica 1 was dead; the restarted replica's first
    commit is past replica 0's step when it was restarted (it caught up rather than starting over);
    the killed processes died of SIGKILL and every other one exited 0 within its join's time."""
    import signal

    from tests.support.torchft_replicas import MODEL, ReplicaGroups, replay

    started = time.monotonic()
    groups = ReplicaGroups(
        tmp_path, "chainermn", replicas=2, ranks=2, heartbeat_timeout_ms=2000, timeout_s=10, deadline_s=150
    )
    try:
        groups.start(0)
        groups.start(1)
        # Both replicas in one quorum for a few steps; then kill replica 1 in the middle of a step.
        groups.wait_for(
            lambda: groups.step(1) >= 3 and groups.commits(1)[-1]["participants"] == 2,
            90,
            "both replicas training in one quorum",
        )
        held = groups.hold(1)
        groups.in_backward(0, held)  # replica 0 is in that step's exchange, which waits for replica 1
        killed_at = groups.kill(1)
        step_at_kill = groups.step(0)

        def alone():
            solo = [c for c in groups.commits(0) if c["t"] > killed_at and c["participants"] == 1]
            return solo if len(solo) >= 3 else None

        solo = groups.wait_for(alone, 30, "replica 0 committing 3 steps alone after the kill")
        step_at_restart = groups.step(0)
        restarted_at = time.time()
        groups.start(1)
        first = groups.wait_for(lambda: groups.commits(1), 60, "the restarted replica's first commit")[0]
        stop = max(groups.step(0), groups.step(1)) + 3
        groups.stop_at(stop)
        ended = groups.join(30)
        errors = groups.errors()
    finally:
        groups.close()
    assert not errors, errors
    assert not ended["hung"], ended
    for (replica, incarnation, rank), code in ended["codes"].items():
        expected = -signal.SIGKILL if (replica, incarnation) == (1, 0) else 0
        assert code == expected, (replica, incarnation, rank, ended)

    # The survivor trained on while replica 1 was dead: consecutive steps, in quorums of itself alone.
    during = [c for c in groups.commits(0, 0) if killed_at < c["t"] < restarted_at]
    assert len(during) >= 3 and step_at_restart > step_at_kill, (during, step_at_kill, step_at_restart)
    assert [c["step"] for c in during] == list(range(during[0]["step"], during[0]["step"] + len(during))), during
    # Its step in flight, whose allreduce waited for the held replica 1, failed when replica 1 died (not
    # at the group timeout), and did not commit; then it trained alone (after the lighthouse's heartbeat
    # timeout). The times are printed below and measured by benchmarks/torchft_kills.py.
    failed = [r for r in groups.progress(0, 0) if r["t"] > killed_at and not r["committed"]]
    assert failed and failed[0]["error"] and "timed out" not in failed[0]["error"], (failed, killed_at)
    assert failed[0]["t"] < solo[0]["t"], (failed[0], solo[0], killed_at)
    # The restarted replica fetched the survivor's state (its first commit is past where it restarted)
    # and ended with the survivor at the stop step.
    assert first["before"] == 0 and first["step"] > step_at_restart, (first, step_at_restart)
    assert any(c["step"] == first["step"] for c in groups.commits(0, 0)), first  # the same step as replica 0
    finals = [groups.final(replica, groups.incarnation[replica], rank) for replica in (0, 1) for rank in (0, 1)]
    assert [f["step"] for f in finals] == [stop] * 4, [f["step"] for f in finals]
    for f in finals:  # both chainermn groups of every rank ran through shared memory, 2 ranks each
        assert f["shared_memory"] == {"replica_group": (True, 2, 2), "torchft_group": (True, 2, 2)}, f
    reference = finals[0]["params"]
    for f in finals[1:]:
        assert all(torch.equal(a, b) for a, b in zip(reference, f["params"])), "ranks' parameters differ"
    expected = replay(MODEL, stop, 2)
    assert all(torch.equal(a, b) for a, b in zip(reference, expected)), "not the replay of the committed steps"
    initial = replay(MODEL, 0, 2)
    assert max((a - b).abs().max().item() for a, b in zip(reference, initial)) > 1e-3
    print(
        f"kill test: {time.monotonic() - started:.1f} s; killed at step {step_at_kill}, "
        f"its step failed {failed[0]['t'] - killed_at:.2f} s after the kill, {len(during)} solo steps, the first "
        f"{solo[0]['t'] - killed_at:.2f} s after the kill, restarted "
        f"replica's first commit (step {first['step']}) {first['t'] - restarted_at:.2f} s after its start"
    )
