"""CUDA tensors on a GPU machine (marked `cuda`: skipped without a GPU, see conftest.py).

Every rank of these runs shares the machine's one GPU. NCCL refuses two ranks on one GPU of one host
("Duplicate GPU detected") unless each rank reports a different host: NCCL hashes NCCL_HOSTID, so
each rank gets its own, and the ranks talk over sockets on loopback (NCCL_SOCKET_IFNAME=lo,
NCCL_IB_DISABLE=1). `nccl_between_ranks()` probes that once: if NCCL refuses or sums wrongly, every
"nccl" test fails with the probe's error. Two more configurations run the same tests: single-rank NCCL
groups (every rank its own simulated node, NCCL within it) with the host transport staged through
pinned memory between them ("nccl_intra"), and the all-staged transport ("staged").
"""

import traceback

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from tests.support.collective_cases import assert_same, expect_value_error, reference_reduce, small_values
from tests.support.harness import cached_launch, run_spawn

pytestmark = pytest.mark.cuda

STRATEGIES = ["naive", "flat", "hierarchical", "two_dimensional", "single_node", "pure_nccl"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIZES = [0, 1, 7, 1000, 1 << 20]


def nccl_one_gpu_env(world_size: int) -> dict:
    """Per-rank environment that lets NCCL put several ranks on one GPU (one simulated host each)."""
    return {
        rank: {"NCCL_HOSTID": f"chainermn-test-host-{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
        for rank in range(world_size)
    }


def probe_all_reduce():
    tensor = torch.full((1000,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    return tensor[0].item()


# The multi-rank CUDA configurations, each named for what it runs: (env, rank_env), where "hostid" gives
# each rank a host id of its own so that NCCL takes two ranks on the one GPU.
CONFIGURATIONS = {
    "staged": ({"CHAINERMN_CUDA_TRANSPORT": "staged"}, None),
    "nccl": ({"CHAINERMN_CUDA_TRANSPORT": "nccl"}, "hostid"),
    # Single-rank NCCL groups (every rank its own simulated node), the host transport staged between them.
    "nccl_intra": ({"CHAINERMN_CUDA_TRANSPORT": "nccl_intra", "CHAINERMN_RANKS_PER_NODE": "1"}, None),
}


def cuda_configurations():
    """CONFIGURATIONS (its env wins over a test's own: nccl_intra needs CHAINERMN_RANKS_PER_NODE=1)."""
    return CONFIGURATIONS


@cached_launch
def nccl_between_ranks():
    """Two-rank NCCL on the one GPU, probed once: a refusal or a wrong sum fails every "nccl" test with
    what the probe saw (never a fallback to another transport under the same name)."""
    values = run_spawn(
        probe_all_reduce,
        2,
        env={"CHAINERMN_CUDA_TRANSPORT": "nccl"},
        rank_env=nccl_one_gpu_env(2),
        timeout=120,
        op_timeout=60,
    )
    if values != [3.0, 3.0]:
        raise AssertionError(f"two-rank NCCL all_reduce of 1 + 2 gave {values} on ranks 0 and 1")
    return values


def run_cuda(fn, world_size, config_name, extra_env=None, nccl_reference=False, **kwargs):
    """Run fn on world_size ranks in the configuration `config_name`. `nccl_reference`: fn also makes
    torch's own nccl groups (to compare with), which need a host id per rank in every configuration."""
    if config_name == "nccl":
        nccl_between_ranks()
    env, rank_env = cuda_configurations()[config_name]
    env = {**(extra_env or {}), **env}
    rank_env = nccl_one_gpu_env(world_size) if rank_env == "hostid" or nccl_reference else None
    return run_spawn(fn, world_size, env=env, rank_env=rank_env, **kwargs)


def config_names():
    return list(CONFIGURATIONS)


# ---- every strategy x dtype x size on CUDA tensors --------------------------------------------------


def cuda_strategy_cases():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    topology = torch_chainermn.topology()
    # single_node on several nodes is refused at creation: it runs on the ranks of one node (the largest:
    # one rank under nccl_intra, where every rank is a node), the others only taking part in new_group.
    node_ranks = max((list(ranks) for ranks in topology.ranks_of_node), key=len)
    outcome = {"__single_node_ranks__": node_ranks}
    for name in STRATEGIES:
        ranks = node_ranks if name == "single_node" else list(range(world_size))
        group = dist.new_group(ranks, backend="chainermn", pg_options=torch_chainermn.Options(communicator=name))
        if rank not in ranks:
            continue
        group_rank, size = dist.get_rank(group), len(ranks)
        for dtype_name, dtype in DTYPES.items():
            case = f"{name}-{dtype_name}"
            try:
                for n in SIZES:
                    for op in ("SUM", "AVG", "MAX"):
                        tensor = small_values(group_rank, (n,), dtype).cuda()
                        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
                        expected = reference_reduce([small_values(r, (n,), dtype) for r in range(size)], op)
                        assert_same(tensor.cpu(), expected, f"{case} all_reduce {op} of {n}")
                tensors = [small_values(group_rank + i, (n,), dtype).cuda() for i, n in enumerate(SIZES)]
                dist.all_reduce_coalesced(tensors, group=group)
                for i, (n, tensor) in enumerate(zip(SIZES, tensors)):
                    expected = reference_reduce([small_values(r + i, (n,), dtype) for r in range(size)], "SUM")
                    assert_same(tensor.cpu(), expected, f"{case} all_reduce_coalesced block {i}")
                outcome[case] = None
            except Exception:  # noqa: BLE001
                outcome[case] = traceback.format_exc()
        # Staging buffers and the pack table stop growing once warmed up.
        try:
            backend = torch_chainermn._backend.backend_of(group)
            for _ in range(2):
                dist.all_reduce_coalesced([torch.ones(n, device="cuda") for n in (1000, 77, 5000)], group=group)
            warmed = backend.scratch_bytes()
            dist.all_reduce_coalesced([torch.ones(n, device="cuda") for n in (1000, 77, 5000)], group=group)
            assert backend.scratch_bytes() == warmed
            outcome[f"{name}-buffers"] = None
        except Exception:  # noqa: BLE001
            outcome[f"{name}-buffers"] = traceback.format_exc()
    return outcome


def check_outcomes(outcomes):
    failures = [
        f"rank {r} {case}:\n{error}"
        for r, outcome in enumerate(outcomes)
        for case, error in outcome.items()
        if error and not case.startswith("__")
    ]
    assert not failures, "\n".join(failures[:5])


def check_strategy_outcomes(outcomes):
    """Every strategy ran on every rank of its group (single_node on the ranks of one node), and right."""
    check_outcomes(outcomes)
    node_ranks = outcomes[0]["__single_node_ranks__"]
    for rank, outcome in enumerate(outcomes):
        ran = {case.rsplit("-", 1)[0] for case in outcome if not case.startswith("__") and "-buffers" not in case}
        assert ran == set(STRATEGIES) - ({"single_node"} if rank not in node_ranks else set()), (rank, sorted(ran))


@pytest.mark.parametrize("config", config_names())
def test_strategies_on_cuda_two_simulated_nodes_of_two(config):
    check_strategy_outcomes(run_cuda(cuda_strategy_cases, 4, config, {"CHAINERMN_RANKS_PER_NODE": "2"}, timeout=600))


@pytest.mark.parametrize("config", config_names())
def test_strategies_on_cuda_one_node(config):
    check_strategy_outcomes(run_cuda(cuda_strategy_cases, 2, config, timeout=600))


# ---- mean_coalesced: one-kernel pack/unpack with cast and scale ------------------------------------


def mean_cases():
    rank, size = dist.get_rank(), dist.get_world_size()
    outcome = {}
    # (70001,) spans many of the kernel's chunks (4096 elements at this total); after (3, 5) every
    # part sits at an odd element offset, so raw moves of 16-bit parts go 2 bytes at a time.
    shapes = [(3, 5), (1,), (1000,), (0,), (257, 3), (70001,)]
    mixes = {
        "float32": [torch.float32] * 6,
        "float16": [torch.float16] * 6,
        "mixed": [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float32, torch.bfloat16],
    }
    for mix_name, dtypes in mixes.items():
        for wire in (None, torch.float16, torch.bfloat16, torch.float32, torch.float64):
            case = f"{mix_name}-{wire}"
            try:

                def values(r):
                    return [
                        small_values(r + i, shape, dtype) * (i + 1)
                        for i, (shape, dtype) in enumerate(zip(shapes, dtypes))
                    ]

                tensors = [t.cuda() for t in values(rank)]
                torch_chainermn.mean_coalesced(tensors, dtype=wire)
                per_rank = [values(r) for r in range(size)]
                for i, tensor in enumerate(tensors):
                    expected = sum(p[i].double() for p in per_rank) / size
                    assert tensor.dtype == dtypes[i] and tensor.is_cuda
                    tolerance = (
                        2e-2
                        if wire in (torch.float16, torch.bfloat16) or dtypes[i] in (torch.float16, torch.bfloat16)
                        else 1e-6
                    )
                    torch.testing.assert_close(tensor.cpu().double(), expected, rtol=tolerance, atol=tolerance)
                outcome[case] = None
            except Exception:  # noqa: BLE001
                outcome[case] = traceback.format_exc()
    return outcome


@pytest.mark.parametrize("config", config_names())
def test_mean_coalesced_on_cuda(config):
    check_outcomes(run_cuda(mean_cases, 2, config, timeout=300))


def compression_cases():
    """Gradient compression of CUDA buffers between 2 nodes, against the CPU reference (2-bit, int8,
    4-bit and top-k: exact)."""
    from tests.support import compression_reference as reference
    from torch_chainermn.compression import GradientCompression

    rank, size = dist.get_rank(), dist.get_world_size()
    outcome = {}
    for kind, compress_result in (
        ("2bit", False),
        ("2bit", True),
        ("1bit", True),
        ("int8", False),
        ("4bit", True),
        ("topk", True),
        ("4bit", "int8"),
    ):
        case = f"{kind}, compress_result={compress_result}"
        try:
            compression = GradientCompression(code=kind, threshold=0.3, compress_result=compress_result)
            inputs = [
                [torch.randn(1001, generator=torch.Generator().manual_seed(100 * step + r)) * 0.4 for r in range(size)]
                for step in range(3)
            ]
            means = reference.compressed_mean_steps(inputs, [[r] for r in range(size)], 3, kind, 0.3, compress_result)[
                0
            ]
            for step in range(3):
                buffer = inputs[step][rank].cuda()
                compression.start([buffer], ((0, 0, buffer.numel()),)).wait()
                if kind != "1bit":
                    assert torch.equal(buffer.cpu(), means[step]), step
                else:  # the GPU sums each chunk's magnitude in another order
                    torch.testing.assert_close(buffer.cpu(), means[step], rtol=1e-5, atol=1e-5)
            outcome[case] = None
        except Exception:  # noqa: BLE001
            outcome[case] = traceback.format_exc()
    return outcome


@pytest.mark.parametrize("config", config_names())
def test_gradient_compression_on_cuda(config):
    check_outcomes(run_cuda(compression_cases, 2, config, extra_env={"CHAINERMN_RANKS_PER_NODE": "1"}, timeout=300))


# ---- stream ordering, futures, refusals -----------------------------------------------------------


def stream_and_future_cases():
    rank, size = dist.get_rank(), dist.get_world_size()
    outcome = {}
    try:
        # Produced by a kernel on a side stream the caller made current: the op must wait for it.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the value is written
            tensor = torch.full((1 << 16,), float(rank + 1), device="cuda")
            work = dist.all_reduce(tensor, async_op=True)
            doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
            work.wait()  # orders `side` after the op; does not block the host on the GPU
            after = tensor + 0
        side.synchronize()
        total = size * (size + 1) / 2
        assert after[0].item() == total and after[-1].item() == total
        assert doubled.wait()[0].item() == 2 * total
        outcome["stream order"] = None
    except Exception:  # noqa: BLE001
        outcome["stream order"] = traceback.format_exc()
    try:
        # A callback issuing the next collective stays ordered too.
        tensor = torch.ones(10, device="cuda")
        fut = dist.all_reduce(tensor, async_op=True).get_future()
        chained = fut.then(lambda f: dist.all_reduce(f.value()[0], async_op=True).get_future().wait()[0])
        assert chained.wait()[0].item() == size * size
        outcome["chained callback"] = None
    except Exception:  # noqa: BLE001
        outcome["chained callback"] = traceback.format_exc()
    try:
        # DDP's setup collectives on CUDA: broadcast and all_gather.
        tensor = torch.full((5,), float(rank), device="cuda")
        dist.broadcast(tensor, src=size - 1)
        assert tensor.cpu().tolist() == [float(size - 1)] * 5
        gathered = [torch.empty(3, device="cuda") for _ in range(size)]
        dist.all_gather(gathered, torch.full((3,), float(rank), device="cuda"))
        assert [g[0].item() for g in gathered] == [float(r) for r in range(size)]
        flat = torch.empty(3 * size, device="cuda")
        dist.all_gather_into_tensor(flat, torch.full((3,), float(rank), device="cuda"))
        assert flat.cpu().tolist() == [float(r) for r in range(size) for _ in range(3)]
        outcome["broadcast and all_gather"] = None
    except Exception:  # noqa: BLE001
        outcome["broadcast and all_gather"] = traceback.format_exc()
    try:
        # Every op has a CUDA path (the funnel runs it on the device's transports); bitwise
        # reductions exist only where the CUDA transport stages through the host library.
        reduced = torch.full((3,), float(rank + 1), device="cuda")
        dist.reduce(reduced, dst=0)
        if rank == 0:
            assert reduced.cpu().tolist() == [float(size * (size + 1) // 2)] * 3
        bits = torch.full((3,), 3 if rank == 0 else 6, dtype=torch.int32, device="cuda")
        if torch_chainermn.get_options().cuda_transport == "staged":
            dist.all_reduce(bits, op=dist.ReduceOp.BAND)
            assert bits.cpu().tolist() == [2] * 3
        else:
            expect_value_error(lambda: dist.all_reduce(bits, op=dist.ReduceOp.BAND), "BAND", "CUDA")
        check = torch.ones(2)
        dist.all_reduce(check)  # the group is still usable, on the CPU too
        assert check.tolist() == [float(size)] * 2
        outcome["refusals"] = None
    except Exception:  # noqa: BLE001
        outcome["refusals"] = traceback.format_exc()
    return outcome


@pytest.mark.parametrize("config", config_names())
def test_streams_futures_and_refusals(config):
    check_outcomes(run_cuda(stream_and_future_cases, 2, config, timeout=300))


def cpu_and_cuda_in_one_group():
    a = torch.ones(100, device="cuda")
    b = torch.ones(100)
    work_a = dist.all_reduce(a, async_op=True)
    work_b = dist.all_reduce(b, async_op=True)
    work_a.wait()
    work_b.wait()
    return a.sum().item(), b.sum().item()


@pytest.mark.parametrize("config", config_names())
def test_cpu_and_cuda_tensors_in_one_group(config):
    for a, b in run_cuda(cpu_and_cuda_in_one_group, 2, config, timeout=120):
        assert a == b == 200.0


# ---- DDP comm hooks on CUDA -----------------------------------------------------------------------


def ddp_cuda_cases():
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch_chainermn import hooks
    from tests.support.training_reference import (
        LR,
        batch,
        make_model,
        max_difference,
        one_step_stale,
        parameters_of,
        synchronous,
    )

    steps = 5
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)

    def train(hook, state, **kwargs):
        model = DDP(make_model().cuda(), device_ids=[0], **kwargs)
        if hook is not None:
            model.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(steps):
            optimizer.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
            optimizer.step()
        if isinstance(state, hooks.DoubleBufferingState):
            state.flush()
        return [p.cpu() for p in parameters_of(model.module)]

    sync, stale = synchronous(size, steps), one_step_stale(size, steps)
    differences = {
        "no hook": max_difference(train(None, None), sync),
        "allreduce_hook": max_difference(train(hooks.allreduce_hook, None, bucket_cap_mb=0.05), sync),
        "fp16_compress_hook": max_difference(train(hooks.fp16_compress_hook, None, bucket_cap_mb=0.05), sync),
        "bf16_compress_hook": max_difference(train(hooks.bf16_compress_hook, None), sync),
        "double buffering": max_difference(
            train(hooks.double_buffering_hook, hooks.DoubleBufferingState(), bucket_cap_mb=0.05), stale
        ),
        "double buffering fp16": max_difference(
            train(hooks.double_buffering_hook, hooks.DoubleBufferingState(compress=torch.float16), bucket_cap_mb=0.05),
            stale,
        ),
    }
    return differences


# GPU float32 math differs from the CPU reference in the last bits; 16-bit wires by more.
DDP_TOLERANCE = {"fp16": 1e-3, "bf16": 3e-3}


@pytest.mark.parametrize("config", config_names())
def test_ddp_hooks_on_cuda(config):
    for differences in run_cuda(ddp_cuda_cases, 2, config, timeout=600):
        for name, difference in differences.items():
            kind = next((k for k in DDP_TOLERANCE if k in name), None)
            assert difference <= DDP_TOLERANCE.get(kind, 1e-4), (name, difference)


# ---- single process: NCCL group of one rank --------------------------------------------------------


def single_rank_nccl():
    """One rank's all_reduce is the identity, which an op that did nothing would pass too: each group also
    gathers into a zeroed output, which only a gather that ran fills."""
    assert torch_chainermn._C.cuda_built
    tensor = torch.arange(10, dtype=torch.float32, device="cuda")
    gathered = []
    for name in STRATEGIES:
        group = dist.new_group([0], backend="chainermn", pg_options=torch_chainermn.Options(communicator=name))
        dist.all_reduce(tensor, group=group)
        out = torch.zeros_like(tensor)
        dist.all_gather_into_tensor(out, tensor * 2, group=group)
        gathered.append(out.cpu().tolist())
    torch_chainermn.mean_coalesced([tensor])
    return tensor.cpu().tolist(), gathered, torch_chainermn._C.nccl_version()


def test_single_rank_nccl_group():
    values, gathered, version = run_spawn(single_rank_nccl, 1, env={"CHAINERMN_CUDA_TRANSPORT": "nccl"}, timeout=120)[0]
    assert values == [float(i) for i in range(10)]
    assert gathered == [[2.0 * i for i in range(10)]] * len(STRATEGIES)
    assert version.startswith("2.")


# ---- a CUDA op that never ends: the watchdog aborts NCCL and names the op ---------------------------


def hung_cuda_collective():
    """Both ranks all_reduce CUDA tensors once on a group with a 10 s timeout (so its NCCL
    communicators exist on both), then rank 0 issues a second all_reduce that rank 1 never joins.
    Over NCCL the kernel is queued at once and waits for a peer that never comes: only the watchdog
    (its device end mark, the cross-rank check beside it, ncclCommAbort) can end it."""
    import datetime
    import time

    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10))
    tensor = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(tensor, group=group)
    torch.cuda.synchronize()
    outcome = {"joined": tensor[0].item()}
    if rank == 0:
        start = time.monotonic()
        work = dist.all_reduce(tensor, group=group, async_op=True)
        try:
            work.wait()  # over NCCL: queued, so it returns (staged: it raises at the timeout)
            torch.cuda.synchronize()  # returns once the watchdog aborted the communicator
            work.wait()  # raises now
            outcome["first"] = "no error"
        except dist.DistBackendError as error:
            outcome["first"] = str(error)
        outcome["seconds"] = time.monotonic() - start
        outcome["completed"] = work.is_completed()
        try:
            dist.all_reduce(tensor, group=group)
            outcome["second"] = "completed"
        except dist.DistBackendError as error:
            outcome["second"] = str(error)
    check = torch.ones(1)
    dist.all_reduce(check)  # the default group is untouched
    outcome["default_group_after"] = check.item()
    return outcome


@pytest.mark.parametrize("config", config_names())
def test_a_hung_cuda_collective_is_aborted_and_named(config):
    outcome = run_cuda(hung_cuda_collective, 2, config, {"TORCH_DISTRIBUTED_DEBUG": "OFF"}, timeout=120, op_timeout=60)[
        0
    ]
    assert outcome["joined"] == 2.0
    assert outcome["completed"] is True
    assert outcome["seconds"] < 10 + 10, outcome  # the group timeout, and the watchdog's margin
    assert "all_reduce (seq 2, rank 0 of 2" in outcome["first"] and "timed out" in outcome["first"], outcome
    assert "unusable" in outcome["second"], outcome
    assert outcome["default_group_after"] == 2.0


# ---- a lost rank on CUDA: the survivors shrink and go on; an abort reaches a pending op -------------


def shrink_and_abort_on_cuda():
    """3 ranks all_reduce CUDA tensors once (so the device transports exist), then rank 2 is SIGKILLed
    while ranks 0 and 1 wait in a CUDA all_reduce, which must fail naming it; they shrink without it
    (SHRINK_ABORT: NCCL's communicators of the old group are aborted) and all_reduce CUDA tensors on
    the new group. Then rank 1 aborts a new group of both while rank 0 waits in a CUDA all_reduce on
    it (over NCCL: a kernel already queued, which only the abort relayed through the store ends)."""
    import datetime
    import os
    import signal
    import time

    rank = dist.get_rank()
    tensor = torch.ones(1 << 16, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    outcome = {"joined": tensor[0].item()}
    store = dist.distributed_c10d._get_default_store()
    if rank == 2:
        store.wait(["rank 0 posted", "rank 1 posted"])  # the others' all_reduce is posted and waits for this rank
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        work = dist.all_reduce(tensor, async_op=True)
        store.set(f"rank {rank} posted", "1")
        work.wait()
        torch.cuda.synchronize()
        work.wait()  # over NCCL the first wait returns once queued: this one reports the failure
        outcome["killed"] = "completed"
    except dist.DistBackendError as error:
        outcome["killed"] = str(error)
    group = dist.shrink_group([2], shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
    value = torch.full((1 << 16,), float(rank + 1), device="cuda")
    dist.all_reduce(value)
    torch.cuda.synchronize()
    outcome.update(resumed_after=time.monotonic() - start, rank=group.rank(), size=group.size(), sum=value[0].item())
    pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    dist.all_reduce(value, group=pair)
    torch.cuda.synchronize()
    if rank == 1:
        store.wait(["pair posted"])  # rank 0's all_reduce on the pair is posted and waits for this rank
        pair.abort()
    else:
        start = time.monotonic()
        try:
            work = dist.all_reduce(value, group=pair, async_op=True)
            store.set("pair posted", "1")
            work.wait()
            torch.cuda.synchronize()
            work.wait()
            outcome["aborted"] = "completed"
        except dist.DistBackendError as error:
            outcome["aborted"] = str(error)
        outcome["abort_seconds"] = time.monotonic() - start  # reported, not asserted
    dist.barrier()  # the shrunk default group is untouched by the pair's abort
    return outcome


@pytest.mark.parametrize("config", config_names())
def test_a_lost_rank_on_cuda_shrink_and_abort(config):
    """The survivors' CUDA all_reduce fails naming the killed rank (not at the 60 s timeout), the
    shrunk group's CUDA all_reduce is right on ranks 0 and 1 of 2, and rank 1's abort fails rank 0's
    pending CUDA all_reduce with its reason."""
    outcomes = run_cuda(
        shrink_and_abort_on_cuda,
        3,
        config,
        {"TORCH_DISTRIBUTED_DEBUG": "OFF"},
        timeout=180,
        op_timeout=60,
        dies={2: "killed by SIGKILL"},
    )
    for rank in (0, 1):
        got = outcomes[rank]
        assert got["joined"] == 3.0 and "rank 2" in got["killed"] and "timed out" not in got["killed"], got
        assert (got["rank"], got["size"], got["sum"]) == (rank, 2, 3.0), got
    said = "rank 1 aborted the group (ProcessGroup.abort())"
    assert said in outcomes[0]["aborted"] and "timed out" not in outcomes[0]["aborted"], outcomes[0]


# ---- what a first GPU run would have hit (issue 21) ---------------------------------------------------


def nccl_readiness_cases():
    """Each case of issue 21 that a GPU can show, on a group of every rank; {case: None or traceback}."""
    rank, size = dist.get_rank(), dist.get_world_size()
    outcome = {}

    def case(name, fn):
        try:
            fn()
            outcome[name] = None
        except Exception:  # noqa: BLE001
            outcome[name] = traceback.format_exc()

    def moves_dtypes_nccl_lacks():
        # Data movement of any dtype goes as bytes; none of these may break the group.
        for dtype in (torch.int16, torch.uint16, torch.uint32, torch.complex64, torch.float8_e4m3fn):
            source = (
                torch.arange(6, dtype=torch.int32).to(dtype)
                if not dtype.is_complex
                else torch.arange(6, dtype=torch.float32).to(dtype)
            )
            tensor = source.cuda() if rank == 0 else torch.zeros_like(source).cuda()
            dist.broadcast(tensor, src=0)
            assert torch.equal(tensor.cpu().view(torch.uint8), source.view(torch.uint8)), dtype
            gathered = torch.zeros(size * 6, dtype=dtype, device="cuda")
            dist.all_gather_into_tensor(gathered, source.cuda())
            assert torch.equal(gathered.cpu().view(torch.uint8), source.view(torch.uint8).repeat(size)), dtype
        with pytest.raises(ValueError, match="cannot reduce"):
            dist.all_reduce(torch.ones(3, dtype=torch.int16, device="cuda"))
        dist.all_reduce(torch.ones(3, device="cuda"))  # still usable

    def any_source_receives_where_the_transport_has_them():
        # NCCL needs the source rank: refused on the caller. A host transport between the ranks has it.
        if torch_chainermn.get_options().cuda_transport == "nccl":
            with pytest.raises(ValueError, match="any source"):
                dist.recv(torch.zeros(3, device="cuda"))  # no src: any source
            return
        if rank == 1:
            dist.send(torch.full((3,), 7.0, device="cuda"), dst=0)
        elif rank == 0:
            received = torch.zeros(3, device="cuda")
            source = dist.recv(received)  # no src: any source
            assert source == 1 and received.cpu().tolist() == [7.0] * 3, (source, received)

    def premul_sum_with_a_device_factor():
        tensor = torch.full((5,), float(rank + 1), device="cuda")
        factor = torch.tensor(0.5, dtype=torch.float64, device="cuda")
        dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(factor))
        expected = 0.5 * sum(range(1, size + 1))
        assert torch.allclose(tensor.cpu(), torch.full((5,), expected)), tensor

    def barrier_orders_the_device():
        # Over NCCL a barrier does as ProcessGroupNCCL's: it returns once the device has run it, and with
        # it what the caller queued before (docs/collectives.md); on the host transports it orders the
        # processes only. Either way a barrier's wait() leaves its Work completed.
        over_nccl = torch_chainermn.get_options().cuda_transport == "nccl"
        for wait in (lambda: dist.barrier(), lambda: dist.barrier(async_op=True).wait()):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued on the caller's stream
            queued = torch.cuda.Event()
            queued.record()
            wait()
            if over_nccl:
                assert queued.query(), "the barrier returned before the device ran what was queued before it"
            torch.cuda.synchronize()
        work = dist.barrier(async_op=True)
        work.wait()
        assert work.is_completed(), "a barrier's Work was not completed after its wait()"

    def destroy_flushes_queued_work():
        group = dist.new_group(list(range(size)))
        tensor = torch.ones(1 << 20, device="cuda")
        for _ in range(20):
            dist.all_reduce(tensor, group=group, async_op=True)
        dist.destroy_process_group(group)  # finalizes NCCL after the work: nothing aborted
        assert tensor[0].item() == float(size) ** 20

    case("moves dtypes NCCL lacks", moves_dtypes_nccl_lacks)
    case("any-source receives where the transport has them", any_source_receives_where_the_transport_has_them)
    case("premul_sum with a device factor", premul_sum_with_a_device_factor)
    case("barrier orders the device", barrier_orders_the_device)
    case("destroy flushes queued work", destroy_flushes_queued_work)
    torch.cuda.synchronize()
    return outcome


@pytest.mark.parametrize("config", config_names())
def test_what_a_first_gpu_run_would_hit(config):
    check_outcomes(run_cuda(nccl_readiness_cases, 2, config, timeout=300, op_timeout=120))


# ---- gradient compression's kernels: CUDA against the CPU (kernels/quantize.h) ---------------------

QUANTIZE_SIZES = [0, 1, 17, 1000, 100003, (1 << 20) + 5]


def quantize_on(device, kind, residual, add, chunk, threshold):
    """(block, residual after) of the kernel on `device`, both copied back to the CPU."""
    residual = residual.to(device, copy=True)  # the kernel updates it in place: each device its own copy
    add = None if add is None else add.to(device)
    block = torch_chainermn._C.testing.quantize(kind, add, residual, chunk, threshold)
    return block.cpu(), residual.cpu()


def dequantize_on(device, kind, block, out, count, threshold, accumulate):
    out = out.to(device, copy=True)  # accumulated into in place: each device its own copy
    torch_chainermn._C.testing.dequantize(kind, block.to(device), out, count, threshold, accumulate)
    return out.cpu()


def quantize_cases():
    """(n, chunk, residual, add or None): every size, as a whole block and as a short last one (the
    tail words zeroed), with and without `add`."""
    generator = torch.Generator().manual_seed(7)
    for n in QUANTIZE_SIZES:
        for chunk in (n, n + 40):
            for with_add in (True, False):
                residual = torch.randn(n, generator=generator)
                residual[::97] = -0.0  # + 0.0f turns -0 into +0: the residual's bits must follow
                add = torch.randn(n, generator=generator) if with_add else None
                yield n, chunk, residual, add


def bits(tensor):
    return tensor.view(torch.int32)


def test_two_bit_kernels_match_the_cpu_bit_for_bit():
    threshold = 0.5
    for n, chunk, residual, add in quantize_cases():
        case = f"n={n} chunk={chunk} add={add is not None}"
        cpu_block, cpu_residual = quantize_on("cpu", "2bit", residual, add, chunk, threshold)
        cuda_block, cuda_residual = quantize_on("cuda", "2bit", residual, add, chunk, threshold)
        assert cpu_block.dtype == cuda_block.dtype == torch.int32, case
        assert cuda_block.numel() == (chunk + 15) // 16, case
        assert torch.equal(cuda_block, cpu_block), case
        assert torch.equal(bits(cuda_residual), bits(cpu_residual)), case
        out = torch.randn(n)
        for accumulate in (False, True):
            expected = dequantize_on("cpu", "2bit", cpu_block, out, n, threshold, accumulate)
            got = dequantize_on("cuda", "2bit", cpu_block, out, n, threshold, accumulate)
            assert torch.equal(bits(got), bits(expected)), f"{case} accumulate={accumulate}"


def test_one_bit_kernels_match_the_cpu():
    """Signs and tail words exact; the scale (mean |r|, summed in double in another order) and so the
    residual to float rounding."""
    for n, chunk, residual, add in quantize_cases():
        case = f"n={n} chunk={chunk} add={add is not None}"
        cpu_block, cpu_residual = quantize_on("cpu", "1bit", residual, add, chunk, 0.0)
        cuda_block, cuda_residual = quantize_on("cuda", "1bit", residual, add, chunk, 0.0)
        assert cuda_block.dtype == torch.int32 and cuda_block.numel() == 1 + (chunk + 31) // 32, case
        assert torch.equal(cuda_block[1:], cpu_block[1:]), case
        cpu_scale, cuda_scale = cpu_block[:1].view(torch.float32), cuda_block[:1].view(torch.float32)
        torch.testing.assert_close(cuda_scale, cpu_scale, rtol=1e-6, atol=0, msg=case)
        torch.testing.assert_close(cuda_residual, cpu_residual, rtol=1e-6, atol=1e-6, msg=case)
        out = torch.randn(n)
        for accumulate in (False, True):
            expected = dequantize_on("cpu", "1bit", cuda_block, out, n, 0.0, accumulate)
            got = dequantize_on("cuda", "1bit", cuda_block, out, n, 0.0, accumulate)
            assert torch.equal(bits(got), bits(expected)), f"{case} accumulate={accumulate}"


def code_cases(code):
    """(rows, count, block, keep, ties) for test_code_operators_match_the_cpu: top-k with several keeps
    (1, a few, all of a block; a short last block) and with many equal magnitudes (its ties)."""
    described = torch_chainermn.codes.describe(code)
    for rows, count, block in ((1, 1, 4), (3, 1000, 256), (2, 37, 5), (2, 70001, 256), (1, 0, 8)):
        block += -block % described["block_multiple"]  # 4-bit blocks are even
        if "keep" not in described["reads"]:
            yield rows, count, block, 8, False
            continue
        for keep in sorted({1, 3, min(8, block), block}):
            for ties in (False, True):
                yield rows, count, block, keep, ties
    if code == "topk":
        yield 2, 70001, 4096, 100, False
        yield 1, 65536 + 999, 65536, 8, True


@pytest.mark.parametrize("code", torch_chainermn.codes.CODES)
def test_code_operators_match_the_cpu(code):
    """torch_chainermn.codes on CUDA: the CPU's wire rows, residuals and decoded values bit for bit
    (1-bit: its scale, summed in another order, to float rounding)."""
    from torch_chainermn.codes import decode, encode, wire_row_bytes

    for rows, count, block, keep, ties in code_cases(code):
        case = f"{code} rows={rows} count={count} block={block} keep={keep} ties={ties}"
        generator = torch.Generator().manual_seed(count)
        x, residual = torch.randn(rows, count, generator=generator), torch.randn(rows, count, generator=generator)
        if ties:  # a few magnitudes only: the selection's ties go to the lower index on both
            x, residual = (x * 2).round() / 2, (residual * 2).round() / 4
        got = {}
        for device in ("cpu", "cuda"):
            kept = residual.to(device, copy=True)
            wire = torch.empty(rows, wire_row_bytes(code, count, block, keep), dtype=torch.uint8, device=device)
            encode(x.to(device), wire, kept, code=code, block=block, threshold=0.5, keep=keep)
            out = torch.empty(rows, count, device=device)
            total = torch.empty(count, device=device)
            decode(wire, out, code=code, block=block, threshold=0.5, keep=keep)
            decode(wire, total, code=code, block=block, threshold=0.5, sum=True, keep=keep)
            got[device] = [t.cpu() for t in (wire, kept, out, total)]
        (cpu_wire, cpu_kept, cpu_out, cpu_total), (wire, kept, out, total) = got["cpu"], got["cuda"]
        if code == "1bit" and count:
            torch.testing.assert_close(
                wire[:, :4].view(torch.float32), cpu_wire[:, :4].view(torch.float32), rtol=1e-6, atol=0, msg=case
            )
            assert torch.equal(wire[:, 4:], cpu_wire[:, 4:]), case
            for a, b in ((kept, cpu_kept), (out, cpu_out), (total, cpu_total)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=case)
        else:
            assert torch.equal(wire, cpu_wire), case
            for a, b in ((kept, cpu_kept), (out, cpu_out), (total, cpu_total)):
                assert torch.equal(bits(a), bits(b)), case
