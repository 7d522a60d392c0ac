"""The flight recorder (docs/observability.md#flight-recorder): the ring in process (its wrap-around, the
states, the dump's keys, a buffer of 0), and on real ranks the dump each rank writes when one rank skips
a collective, read by torch's analyzer through `python -m torch_chainermn.fr_trace`."""

import os
import pickle
import time
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import REPO, run_spawn

from torch_chainermn._C import testing


def _ring(capacity):
    return testing.FlightRecorderRing(capacity, [4, 5, 6], 1, "7", "default_pg")


STARTED_COMPLETED = ("time_discovered_started_ns", "time_discovered_completed_ns")


def test_the_ring_keeps_the_last_ops_with_their_states_in_torchs_format():
    ring = _ring(3)
    x = torch.zeros(2, 8)
    ids = [ring.record("all_reduce", seq, 0, -1, [x], [x]) for seq in range(1, 5)]
    ring.started(ids[1])
    ring.ended(ids[1], True)  # completed
    ring.started(ids[2])
    ring.ended(ids[3], False)  # failed before it started: retired, still scheduled
    ring.ended(ids[0], True)  # overwritten by the fourth op: changes nothing
    chunk = torch.zeros(8, dtype=torch.float16)
    send = ring.record("send", 4, 1, 2, [chunk], [chunk])
    gathered = [torch.zeros(8, dtype=torch.float16) for _ in range(3)]
    gather = ring.record("all_gather", 5, 1, -1, [chunk], gathered)

    trace = pickle.loads(ring.dump())
    assert trace["version"] == "2.10"
    assert trace["pg_config"] == {"7": {"name": "7", "desc": "default_pg", "ranks": "[4, 5, 6]"}}
    assert trace["pg_status"] == {
        "0": {"last_enqueued_collective": 5, "last_started_collective": 3, "last_completed_collective": 2}
    }
    entries = trace["entries"]
    # Capacity 3: the last three ops, oldest first, their record ids in order.
    assert [e["record_id"] for e in entries] == [ids[3], send, gather] == [3, 4, 5]
    failed, sent, all_gather = entries
    assert failed["profiling_name"] == "chainermn:all_reduce"
    assert (failed["state"], failed["retired"], failed["time_discovered_started_ns"]) == ("scheduled", True, None)
    assert failed["input_sizes"] == failed["output_sizes"] == [[2, 8]]
    assert failed["input_dtypes"] == ["Float"]
    assert (failed["collective_seq_id"], failed["process_group"], failed["is_p2p"]) == (4, ("7", "default_pg"), False)
    assert failed["frames"] == [] and failed["timeout_ms"] == 1000
    # Rank 1 of its group sends to group rank 2, as torch's analyzer parses it.
    assert sent["profiling_name"] == "chainermn:send 1->2" and sent["is_p2p"] and sent["p2p_seq_id"] == 1
    # An all_gather's outputs as the one stacked tensor torch's nccl records (the analyzer checks it).
    assert all_gather["output_sizes"] == [[3, 8]] and all_gather["output_dtypes"] == ["Half"]
    assert all_gather["op_id"] == 6

    ring2 = _ring(8)
    wall_before = time.time_ns()
    done = ring2.record("barrier", 1, 0, -1, [], [torch.zeros(1)])
    running = ring2.record("barrier", 2, 0, -1, [], [torch.zeros(1)])
    ring2.started(done)
    ring2.ended(done, True)
    ring2.started(running)
    entries = pickle.loads(ring2.dump())["entries"]
    assert [e["state"] for e in entries] == ["completed", "started"]
    assert entries[0]["duration_ms"] >= 0 and "duration_ms" not in entries[1]
    assert entries[0]["time_discovered_completed_ns"] >= entries[0]["time_discovered_started_ns"] > 0
    # The times are the wall clock's nanoseconds, as torch's (recorded as TSC ticks, converted at the
    # dump: os/tick_clock.h); a millisecond of slack for the conversion's rate.
    created, started, completed = (entries[0][k] for k in ("time_created_ns", *STARTED_COMPLETED))
    assert wall_before - 1_000_000 <= created <= started <= completed <= time.time_ns() + 1_000_000
    assert abs(entries[0]["duration_ms"] - (completed - started) / 1e6) < 0.01
    assert [e["record_id"] for e in pickle.loads(ring2.dump(only_active=True))["entries"]] == [running]


def test_a_buffer_of_zero_records_nothing():
    ring = _ring(0)
    x = torch.zeros(4)
    ids = [ring.record("all_reduce", seq, 0, -1, [x], [x]) for seq in (1, 2)]
    for op in ids:
        ring.started(op)
        ring.ended(op, True)
    trace = pickle.loads(ring.dump())
    assert trace["entries"] == [] and trace["pg_status"]["0"]["last_enqueued_collective"] == -1


def one_rank_skips(skipper, peer):
    """Every rank runs all_reduces; then all but `skipper` run one more, which `skipper` skips to
    wait for a message from `peer` that never comes (a pipeline stage that went ahead). Returns what each
    rank's op raised and its own dump as the backend wrote it."""
    rank = dist.get_rank()
    x = torch.ones(1024)
    dist.all_reduce(x)
    dist.all_reduce(x)  # a collective's sequence number is not the receive's: the analyzer groups those
    try:
        if rank == skipper:
            dist.recv(torch.empty(4), peer)
        else:
            dist.all_reduce(x)
        raised = ""
    except Exception as error:  # noqa: BLE001  the failure each rank reports
        raised = str(error)
    path = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)
    assert os.path.exists(path), f"rank {rank} raised before its dump was written: {raised}"
    with open(path, "rb") as f:
        written = pickle.load(f)
    return raised, written


@pytest.mark.parametrize("world_size, ranks_per_node", [(3, None), (4, 2)], ids=["3-ranks", "2-nodes-of-2"])
def test_each_rank_dumps_and_the_analyzer_names_the_rank_that_skipped(world_size, ranks_per_node):
    skipper = world_size - 1
    with tempfile.TemporaryDirectory(prefix="chainermn-fr-") as folder:
        env = {"TORCH_FR_DUMP_TEMP_FILE": os.path.join(folder, "trace_")}
        if ranks_per_node:
            env["CHAINERMN_RANKS_PER_NODE"] = str(ranks_per_node)
        outcomes = run_spawn(
            one_rank_skips, world_size, skipper, 0, env=env, op_timeout=4, timeout=120, group_may_break=True
        )
        for rank, (raised, written) in enumerate(outcomes):
            assert raised, (rank, "the op did not fail")
            first, second = [e for e in written["entries"] if e["process_group"][1] == "default_pg"][-2:]
            assert (first["profiling_name"], first["state"]) == ("chainermn:all_reduce", "completed"), first
            expected = f"chainermn:recv {rank}<-0" if rank == skipper else "chainermn:all_reduce"
            # Written before the op raised: running, not yet retired.
            assert (second["profiling_name"], second["state"], second["retired"]) == (expected, "started", False)
            assert written["pg_config"][second["process_group"][0]]["ranks"] == str(list(range(world_size)))
        assert sorted(os.listdir(folder)) == [f"trace_{rank}" for rank in range(world_size)]

        analyzed = subprocess.run(
            [sys.executable, "-m", "torch_chainermn.fr_trace", folder],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        report = analyzed.stdout + analyzed.stderr
        assert analyzed.returncode == 0, report
        # The last all_reduce: the ranks that joined it, and the one that did not, named.
        seq = outcomes[0][1]["entries"][-1]["collective_seq_id"]
        block = re.search(
            rf"Not all ranks joining collective, sequence number: {seq}\n(.*?)collective state", report, re.S
        )
        assert block, report
        assert "collective: chainermn:all_reduce" in block.group(1), report
        assert f"missing ranks: {{{skipper}}}" in block.group(1), report


def mismatched_sizes():
    """Rank 1 passes twice as many values: the ranks' check fails the op on both, each writes its dump."""
    rank = dist.get_rank()
    try:
        dist.all_reduce(torch.ones(4 * (rank + 1)))
        raised = ""
    except Exception as error:  # noqa: BLE001  the mismatch each rank reports
        raised = str(error)
    with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "rb") as f:
        return raised, pickle.load(f)["entries"][-1]["input_sizes"]


def test_a_mismatch_the_check_finds_is_dumped_on_every_rank():
    with tempfile.TemporaryDirectory(prefix="chainermn-fr-") as folder:
        env = {"TORCH_FR_DUMP_TEMP_FILE": os.path.join(folder, "trace_")}
        outcomes = run_spawn(mismatched_sizes, 2, env=env, timeout=90)
    for rank, (raised, sizes) in enumerate(outcomes):
        assert "all_reduce" in raised, (rank, raised)
        assert sizes == [[4 * (rank + 1)]], (rank, sizes)
