"""What torch's profiler sees of chainermn (docs/observability.md): every op a span named as torch names
gloo's ("chainermn:all_reduce"), with its tensors' shapes, and inside it the phases it ran
(csrc/phase.h): within the node, between nodes (with the transport and bytes), a code's encode and
decode, the wait for a peer and the ranks' check. Real ranks, torch.profiler, its key_averages() and
its Chrome trace; the op runs on the caller's thread (a blocking op over shared memory) and on the
group's worker (an async op), and nothing is recorded once the profiler stops."""

import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from tests.support.harness import run_spawn

OPS = (
    "chainermn:all_reduce",
    "chainermn:all_gather_into_tensor",
    "chainermn:barrier",
    "chainermn:send",
    "chainermn:recv",
)
PHASES = (
    "chainermn:within_node",
    "chainermn:between_nodes",
    "chainermn:wait_peers",
    "chainermn:check",
    "chainermn:encode",
    "chainermn:decode",
)


def _parents(prof):
    """{phase name: sorted names of the nearest chainermn span each was found inside (an op, or another
    phase: the check's exchange runs inside it)}, from the profiler's own tree."""
    found = {}
    for event in prof.events():
        if event.name in PHASES:
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("chainermn:"):
                parent = parent.cpu_parent
            found.setdefault(event.name, set()).add(parent.name if parent is not None else None)
    return {name: sorted(parents, key=str) for name, parents in found.items()}


def profiled_ops(with_compression):
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.full((1024,), float(rank + 1))  # 4 KiB
    gathered = torch.empty(1024 * size)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(x)  # blocking, over shared memory: on the caller's thread
        dist.all_reduce(x, async_op=True).wait()  # on the group's worker
        dist.all_gather_into_tensor(gathered, x)
        if rank < 2:
            peer = 1 - rank
            y = torch.arange(8, dtype=torch.float64)
            if rank == 0:
                dist.send(y, peer)
            else:
                dist.recv(y, peer)
        dist.barrier()
        if with_compression:
            from torch_chainermn.compression import GradientCompression

            grads = torch.randn(4096)
            compression = GradientCompression(code="int8")
            compression.start([grads], [(id(grads), 0, grads.numel())]).wait()
    after = torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as unrelated:
        torch.ones(2).add_(1)  # no op of the group: nothing of ours may appear
    dist.all_reduce(after)  # outside any profiler: recorded nowhere

    averages = {event.key: event.count for event in prof.key_averages()}
    shapes = sorted(
        {
            str(event.input_shapes)
            for event in prof.key_averages(group_by_input_shape=True)
            if event.key == "chainermn:all_reduce"
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    trace_events = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("chainermn:")]
    between = [e.get("args", {}) for e in trace_events if e["name"] == "chainermn:between_nodes"]
    return {
        "averages": {k: v for k, v in averages.items() if k.startswith("chainermn:")},
        "all_reduce_shapes": shapes,
        "parents": _parents(prof),
        "trace_names": sorted({e["name"] for e in trace_events}),
        "between_args": between,
        "between_kwinputs": [e.kwinputs for e in prof.events() if e.name == "chainermn:between_nodes"],
        "unrelated": sorted(e.key for e in unrelated.key_averages() if e.key.startswith("chainermn:")),
        "result": x[:2].tolist(),
    }


def test_ops_and_their_phases_on_one_node():
    results = run_spawn(profiled_ops, 2, False)
    for rank, out in enumerate(results):
        averages = out["averages"]
        assert averages.get("chainermn:all_reduce") == 2, (rank, averages)
        for op in (
            "chainermn:all_gather_into_tensor",
            "chainermn:barrier",
            "chainermn:send" if rank == 0 else "chainermn:recv",
        ):
            assert averages.get(op) == 1, (rank, op, averages)
        # 4 KiB of float32 as the op's input shape.
        assert out["all_reduce_shapes"] == ["[[1024]]"], (rank, out["all_reduce_shapes"])
        # Shared memory carries everything on one node: its phase is inside the op, on either thread.
        assert out["parents"]["chainermn:within_node"] == [
            "chainermn:all_gather_into_tensor",
            "chainermn:all_reduce",
            "chainermn:barrier",
        ], (rank, out["parents"])
        assert "chainermn:between_nodes" not in out["parents"], (rank, out["parents"])
        assert {"chainermn:all_reduce", "chainermn:within_node"} <= set(out["trace_names"]), (rank, out)
        assert out["unrelated"] == [], (rank, out["unrelated"])
        assert out["result"] == [6.0, 6.0]  # 1 + 2, then that summed over the two ranks again


def test_the_exchange_between_nodes_and_a_code_on_two_nodes_of_two():
    results = run_spawn(profiled_ops, 4, True, env={"CHAINERMN_RANKS_PER_NODE": "2"}, timeout=240)
    for rank, out in enumerate(results):
        parents = out["parents"]
        assert "chainermn:all_reduce" in parents["chainermn:within_node"], (rank, parents)
        # hierarchical (the default): only a node's first rank crosses between nodes.
        if rank % 2 == 0:
            assert "chainermn:all_reduce" in parents["chainermn:between_nodes"], (rank, parents)
            # The transport and this rank's bytes (1024 float32 values), in Python and in the Chrome trace.
            assert {"what": "gloo", "bytes": 4096} in out["between_kwinputs"], (rank, out["between_kwinputs"])
            assert any(args.get("what") == "gloo" and args.get("bytes") == 4096 for args in out["between_args"]), (
                rank,
                out["between_args"],
            )
            # A node's first rank codes what it sends to the other nodes, inside the compressed mean.
            assert parents["chainermn:encode"] == ["chainermn:gradient_compression"], (rank, parents)
            assert parents["chainermn:decode"] == ["chainermn:gradient_compression"], (rank, parents)
        assert out["result"] == [40.0, 40.0]  # 1 + 2 + 3 + 4, then that summed over the four ranks again
