"""python -m torch_chainermn.timeline (docs/observability.md, "A picture"): real ranks profiled by
torch.profiler, one of them sleeping before each op; the timeline read from their Chrome traces has
every rank's ops with their phases, matches the collectives across the ranks, names the sleeper as the
straggler, and the command draws the PNG. The same from flight-recorder dumps in torch's format, as
torch's gloo backend writes them. A folder that holds no usable trace is refused with a message
naming the file and what is wrong with it."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from tests.support.harness import REPO, run_spawn
from torch_chainermn.timeline import TimelineError, load

SLEEPER = 2
SLEEP_S = 0.1
OPS = ["all_reduce"] * 4 + ["all_gather_into_tensor", "barrier"]


def profiled_with_a_sleeper(folder):
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.ones(1024)
    gathered = torch.empty(1024 * size)
    # Starting the profiler takes a rank up to a fraction of a second on a busy machine: a warm-up step
    # (not recorded) absorbs it, so that no rank enters the first op late for that reason.
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=1)) as prof:
        dist.barrier()
        prof.step()
        for name in OPS:
            if rank == SLEEPER:
                time.sleep(SLEEP_S)
            if name == "all_reduce":
                dist.all_reduce(x)
            elif name == "all_gather_into_tensor":
                dist.all_gather_into_tensor(gathered, x)
            else:
                dist.barrier()
    prof.export_chrome_trace(os.path.join(folder, f"rank{rank}.json"))


def test_the_rank_that_sleeps_before_each_op_is_named_the_straggler(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    run_spawn(profiled_with_a_sleeper, 3, str(traces))

    timeline = load(traces)
    assert [trace.rank for trace in timeline.ranks] == [0, 1, 2]
    for trace in timeline.ranks:
        assert [op.name for op in trace.ops] == OPS, (trace.rank, [op.name for op in trace.ops])
        # One node: shared memory carries every op, inside the op's own time.
        for op in trace.ops:
            phases = [phase for phase in op.phases if phase.name == "within_node"]
            assert phases, (trace.rank, op)
            assert all(op.start_ns <= phase.start_ns <= phase.end_ns <= op.end_ns for phase in op.phases), op
    assert [(c.name, sorted(c.ops)) for c in timeline.collectives] == [(name, [0, 1, 2]) for name in OPS]
    assert timeline.unmatched == []
    assert timeline.straggler == SLEEPER
    summaries = {s.rank: s for s in timeline.summaries}
    assert summaries[SLEEPER].times_last > len(OPS) / 2, summaries
    # Every rank waited for the last one; the last one itself only where another rank came after it.
    assert summaries[0].waited_ns > 0 and summaries[1].waited_ns > 0, summaries

    # The command: the analysis on stdout, the picture written.
    picture = tmp_path / "timeline.png"
    done = subprocess.run(
        [sys.executable, "-m", "torch_chainermn.timeline", str(traces), "-o", str(picture)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"straggler: rank {SLEEPER}" in done.stdout, done.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    height, width = imread(picture).shape[:2]
    assert width == 1200 and height > 200, (width, height)  # 12 inches at 100 dpi, a row per rank


def dumped_with_a_sleeper(folder):
    """The ops run on a gloo group, recorded by torch's own flight recorder; each rank writes its dump
    as torch's debug-info writer names it (a prefix, then the rank)."""
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    x = torch.ones(1024)
    for _ in range(3):
        if rank == SLEEPER:
            time.sleep(SLEEP_S)
        dist.all_reduce(x, group=group)
    if rank == SLEEPER:
        time.sleep(SLEEP_S)
    dist.barrier(group=group)
    with open(os.path.join(folder, f"fr_trace_rank_{rank}"), "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())
    return group.group_name


def test_flight_recorder_dumps_of_torchs_gloo_name_the_straggler(tmp_path):
    names = run_spawn(dumped_with_a_sleeper, 3, str(tmp_path), env={"TORCH_FR_BUFFER_SIZE": "100"})

    timeline = load(tmp_path)
    assert [trace.rank for trace in timeline.ranks] == [0, 1, 2]
    on_gloo = [c for c in timeline.collectives if all(op.group == names[0] for op in c.ops.values())]
    # Matched by the group's sequence numbers, in the order the ranks ran them.
    assert [(c.name, sorted(c.ops), [op.seq for op in c.ops.values()]) for c in on_gloo] == [
        (name, [0, 1, 2], [seq] * 3) for seq, name in enumerate(["all_reduce"] * 3 + ["barrier"], start=1)
    ]
    assert timeline.straggler == SLEEPER
    assert {s.rank: s.times_last for s in timeline.summaries}[SLEEPER] > len(on_gloo) / 2, timeline.summaries
    picture = tmp_path / "timeline.png"
    from torch_chainermn.timeline import draw

    draw(timeline, picture)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write(path, content):
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_folder_with_no_usable_trace_is_refused_naming_the_file(tmp_path):
    with pytest.raises(TimelineError, match="no profiler trace in it"):
        load(tmp_path)
    with pytest.raises(TimelineError, match="no such folder"):
        load(tmp_path / "absent")

    broken = _write(tmp_path / "rank0.json", '{"traceEvents": [')
    with pytest.raises(TimelineError, match=re.escape(f"{broken}: not a readable profiler trace")):
        load(tmp_path)

    _write(broken, {"schemaVersion": 1})
    with pytest.raises(TimelineError, match="no 'traceEvents' list"):
        load(tmp_path)

    _write(broken, {"traceEvents": []})
    with pytest.raises(TimelineError, match="names no rank"):
        load(tmp_path)

    # A rank whose profiler saw none of the backend's ops.
    unrelated = {
        "distributedInfo": {"rank": 0},
        "baseTimeNanoseconds": 0,
        "traceEvents": [{"ph": "X", "name": "aten::add_", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}],
    }
    _write(broken, unrelated)
    with pytest.raises(TimelineError, match="rank 0's trace holds no chainermn span"):
        load(tmp_path)

    # A phase with no op around it.
    _write(broken, {**unrelated, "traceEvents": [{**unrelated["traceEvents"][0], "name": "chainermn:within_node"}]})
    with pytest.raises(TimelineError, match="phases of the backend but no op span"):
        load(tmp_path)

    # Two files of one rank (two runs in one folder).
    op = {"ph": "X", "name": "chainermn:all_reduce", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}
    _write(broken, {**unrelated, "traceEvents": [op]})
    _write(tmp_path / "rank0-again.json", {**unrelated, "traceEvents": [op]})
    with pytest.raises(TimelineError, match="two files of rank 0"):
        load(tmp_path)

    # A flight-recorder dump (a name ending in the rank) beside the traces; then alone, and not a dump.
    dump = _write(tmp_path / "fr_trace_rank_1", "not a pickle")
    with pytest.raises(TimelineError, match="both profiler traces .* and flight-recorder dumps"):
        load(tmp_path)
    for trace in tmp_path.glob("*.json"):
        trace.unlink()
    with pytest.raises(TimelineError, match=re.escape(f"{dump}: not a flight-recorder dump")):
        load(tmp_path)

    # The command says it on stderr and fails.
    done = subprocess.run(
        [sys.executable, "-m", "torch_chainermn.timeline", str(tmp_path / "absent")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "no such folder" in done.stderr, (done.returncode, done.stderr)
