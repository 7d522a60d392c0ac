"""Gradient compression (MXNet's 2-bit, 1-bit sign): the kernels, the backend's mean, and the
hook, communicator and optimizer on real processes, each against tests/support/compression_reference.py."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_chainermn
from torch_chainermn import _C, hooks
from torch_chainermn.codes import CODES, CompressionSpec
from torch_chainermn.compression import GradientCompression, layout_of
from tests.support import compression_reference as reference
from tests.support.collective_cases import value_errors
from tests.support.harness import run_spawn


def values(count: int, seed: int, scale: float = 0.4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, generator=generator) * scale


# ---- the kernels --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
@pytest.mark.parametrize("count, extra", [(0, 0), (1, 0), (17, 40), (1000, 0), (4099, 33)])
@pytest.mark.parametrize("with_add", [False, True])
def test_kernels_equal_the_reference_bit_for_bit(kind, count, extra, with_add):
    chunk = count + extra
    residual = values(count, 1)
    add = values(count, 2) if with_add else None
    expected_block, expected_residual, expected_sent = reference.quantize(kind, residual, add, chunk, 0.3)
    block = _C.testing.quantize(kind, add, residual, chunk, 0.3)
    assert torch.equal(block, expected_block)
    assert torch.equal(residual, expected_residual)
    out = torch.full((count,), 7.0)
    _C.testing.dequantize(kind, block, out, count, 0.3, accumulate=False)
    assert torch.equal(out, expected_sent)
    _C.testing.dequantize(kind, block, out, count, 0.3, accumulate=True)
    assert torch.equal(out, expected_sent + expected_sent)


def test_two_bit_sends_threshold_steps_and_keeps_the_rest():
    residual = torch.tensor([0.2, 0.7, -0.6, 1.4, -0.5, 0.5])
    _C.testing.quantize("2bit", None, residual, 16, 0.5)
    assert residual.tolist() == pytest.approx([0.2, 0.2, -0.1, 0.9, 0.0, 0.0])


# ---- the backend's mean, ranks as threads --------------------------------------------------------

MEAN_CASES = [
    # nodes, kind, compress_result, result dtype
    (["a", "b"], "2bit", False, torch.float32),
    (["a", "a", "b", "b"], "2bit", False, torch.float32),
    (["a", "a", "b", "b"], "2bit", True, torch.float32),
    (["a", "a", "b", "b"], "1bit", True, torch.float32),
    (["a", "b", "c"], "1bit", False, torch.float16),
    (["a", "b", "c"], "2bit", False, torch.bfloat16),
    (["a", "a"], "2bit", False, torch.float32),  # one node: nothing compressed
    # The block codes (block 64: chunks of whole blocks), which keep the gradients' scale.
    (["a", "a", "b", "b"], "int8", False, torch.float32),
    (["a", "b", "c"], "int8", True, torch.float32),
    (["a", "b"], "4bit", False, torch.float32),
    (["a", "a", "b", "b"], "4bit", True, torch.float32),
    (["a", "b", "b"], "int2", False, torch.float32),
    # top-k (keep 8 of each block of 64), the error feedback of DiLoCo's sparse outer gradients.
    (["a", "a", "b", "b"], "topk", False, torch.float32),
    (["a", "b", "c"], "topk", True, torch.float32),
    # The sums in another code: 4 bits there and 8 back; a word code there and a block code back (the
    # chunks are whole blocks).
    (["a", "a", "b", "b"], "4bit", "int8", torch.float32),
    (["a", "b", "c"], "2bit", "4bit", torch.float32),
]


def test_every_registered_code_has_a_mean_case():
    """The backend's mean is checked against the reference for every code of the registry."""
    assert {kind for _, kind, _, _ in MEAN_CASES} == set(CODES)


@pytest.mark.parametrize("names, kind, compress_result, result_dtype", MEAN_CASES)
def test_mean_equals_the_reference_step_by_step(names, kind, compress_result, result_dtype):
    count, steps, block = 1001, 3, 64
    inputs = [values(count, 10 + rank) for rank in range(len(names))]
    spec = CompressionSpec(kind, threshold=0.3, compress_result=compress_result, result_dtype=result_dtype, block=block)
    results, firsts, seconds = _C.testing.compressed_mean_steps(names, inputs, steps, spec, shared_memory=True)
    nodes = [[r for r, n in enumerate(names) if n == name] for name in dict.fromkeys(names)]
    means, first, second = reference.compressed_mean_steps(
        [inputs] * steps, nodes, steps, kind, 0.3, compress_result, result_dtype, block=block
    )
    for step in range(steps):
        for rank in range(len(names)):
            assert torch.equal(results[step][rank], means[step]), (step, rank)
    for node, ranks in enumerate(nodes):
        leader = ranks[0]
        if len(nodes) == 1:
            assert firsts[leader].numel() == 0
            continue
        assert torch.equal(firsts[leader], first[node])
        if compress_result:
            chunk = reference.chunk_for(count, len(nodes), kind, compress_result, block)
            used = min(count - node * chunk, chunk)
            assert torch.equal(seconds[leader][:used], second[node][:used])
        for rank in ranks[1:]:
            assert firsts[rank].numel() == 0 and seconds[rank].numel() == 0


@pytest.mark.parametrize("keep", [1, 3, 64])
def test_topk_mean_takes_keep(keep):
    """The mean's `keep` reaches the code (1, 3 and all of a block of 64): against the reference."""
    names, count, steps, block = ["a", "b", "b"], 1001, 3, 64
    inputs = [values(count, 20 + rank) for rank in range(len(names))]
    results, firsts, _ = _C.testing.compressed_mean_steps(
        names, inputs, steps, CompressionSpec("topk", block=block, keep=keep)
    )
    means, first, _ = reference.compressed_mean_steps(
        [inputs] * steps, [[0], [1, 2]], steps, "topk", block=block, keep=keep
    )
    for step in range(steps):
        for rank in range(len(names)):
            assert torch.equal(results[step][rank], means[step]), (step, rank)
    assert torch.equal(firsts[0], first[0]) and torch.equal(firsts[1], first[1])


def test_mean_without_compression_sends_the_residual_nowhere():
    """Error feedback loses nothing: over many steps the sum of what was sent approaches the sum of
    the gradients, off by at most what the residuals hold."""
    names, count, steps = ["a", "b"], 64, 20
    inputs = [values(count, 30 + rank, scale=0.1) for rank in range(2)]
    results, firsts, _ = _C.testing.compressed_mean_steps(names, inputs, steps, CompressionSpec("2bit", threshold=0.5))
    delivered = sum(result[0] for result in results) * 2
    owed = firsts[0] + firsts[1]
    assert torch.allclose(delivered + owed, (inputs[0] + inputs[1]) * steps, atol=1e-4)
    assert delivered.abs().max() > 0  # values far below the threshold still got through


# ---- real processes: the hook, relayout, checkpoints, the communicator, errors --------------------

SIZES = {"a": 300, "b": 350, "c": 1000}


class Known(torch.nn.Module):
    """Parameters whose gradients are the given tensors: loss = sum of param * gradient."""

    def __init__(self):
        super().__init__()
        for name, count in SIZES.items():
            setattr(self, name, torch.nn.Parameter(torch.zeros(count)))

    def forward(self, grads):
        return sum((getattr(self, name) * grads[name]).sum() for name in SIZES)


def gradients(rank: int, step: int) -> dict:
    return {name: values(count, 1000 * step + 10 * rank + i) for i, (name, count) in enumerate(SIZES.items())}


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[name].reshape(-1) for name in SIZES])


def expected_means(steps, residuals=None, **settings):
    """The reference means (flat, in SIZES order) of the ranks' gradients, 2-bit elementwise."""
    size = dist.get_world_size()
    per_node = torch_chainermn.topology().intra_size
    nodes = [list(range(n, n + per_node)) for n in range(0, size, per_node)]
    inputs = [[flat(gradients(rank, step)) for rank in range(size)] for step in range(steps)]
    return reference.compressed_mean_steps(inputs, nodes, steps, "2bit", residuals=residuals, **settings)[0]


def process_cases():
    rank, threshold = dist.get_rank(), 0.5
    outcome = {}

    # The DDP hook, several buckets (which DDP rebuilds after step 1), against the reference.
    model = DDP(Known(), bucket_cap_mb=0.002)
    state = hooks.GradientCompressionState(code="2bit", threshold=threshold)
    model.register_comm_hook(state, hooks.gradient_compression_hook)
    expected = expected_means(4)
    hook_exact, layouts_seen = [], None
    for step in range(4):
        model.zero_grad()
        model(gradients(rank, step)).backward()
        got = torch.cat([getattr(model.module, name).grad for name in SIZES])
        hook_exact.append(torch.equal(got, expected[step]))
        layouts_seen = layouts_seen if step else [set(state._residuals)]
    outcome["hook"] = hook_exact
    outcome["hook rebuilt"] = set(state._residuals) != layouts_seen[0]  # DDP's rebuild was crossed

    # Double buffered: step k applies step k-1's compressed mean (zeros at step 0), across the rebuild.
    db_model = DDP(Known(), bucket_cap_mb=0.002)
    db = hooks.DoubleBufferingState(compress=hooks.GradientCompressionState(code="2bit", threshold=threshold))
    db_model.register_comm_hook(db, hooks.double_buffering_hook)
    stale = []
    for step in range(3):
        db_model.zero_grad()
        db_model(gradients(rank, step)).backward()
        got = torch.cat([getattr(db_model.module, name).grad for name in SIZES])
        stale.append(torch.equal(got, torch.zeros_like(got) if step == 0 else expected[step - 1]))
    db.flush()
    outcome["double buffering"] = stale

    # A new layout of the same parameters (as DDP's rebuild makes) carries each one's residual.
    compression = GradientCompression(code="2bit", threshold=threshold)
    params = {name: torch.nn.Parameter(torch.zeros(count)) for name, count in SIZES.items()}
    layouts = [[["a", "b"], ["c"]], [["a", "b"], ["c"]], [["c", "a"], ["b"]], [["b"], ["c", "a"]]]
    relayout_exact = []
    for step, layout in enumerate(layouts):
        grads, got = gradients(rank, step), {}
        works = []
        for i, names in enumerate(layout):
            buffer = torch.cat([grads[name] for name in names])
            layout_params = layout_of([grads[name] for name in names], [params[name] for name in names])
            works.append((names, buffer, compression.start([buffer], layout_params, last=i == len(layout) - 1)))
        for names, buffer, work in works:
            work.wait()
            for name, part in zip(names, buffer.split([SIZES[n] for n in names])):
                got[name] = part
        relayout_exact.append(torch.equal(flat(got), expected[step]))
    outcome["relayout"] = relayout_exact

    # A checkpoint keeps what is owed: a restored state continues with node 0 owing the sum.
    saved = compression.state_dict()
    restored = GradientCompression(code="2bit", threshold=threshold)
    restored.load_state_dict(saved)
    again = restored.state_dict()
    outcome["round trip"] = all(torch.equal(saved["residuals"][k], again["residuals"][k]) for k in saved["residuals"])
    owed = torch.cat([saved["residuals"][i] for i in range(3)])  # first sight: a, b, c
    nodes = len(range(0, dist.get_world_size(), torch_chainermn.topology().intra_size))
    start = [owed] + [torch.zeros_like(owed)] * (nodes - 1)
    grads = gradients(rank, 0)
    buffer = flat(grads)
    restored.start([buffer], layout_of([grads[n] for n in SIZES], [params[n] for n in SIZES])).wait()
    outcome["restored step"] = torch.equal(buffer, expected_means(1, residuals=start)[0])

    # The communicator and the multi-node optimizer take the same settings.
    comm = torch_chainermn.create_communicator("flat", gradient_compression={"code": "2bit", "threshold": threshold})
    known = Known()
    known(gradients(rank, 0)).backward()
    comm.multi_node_mean_grad(known)
    by_name = {name: getattr(known, name).grad for name in sorted(SIZES)}
    outcome["communicator"] = torch.equal(torch.cat([by_name[n] for n in SIZES]), expected[0])
    optimizer = torch_chainermn.create_multi_node_optimizer(torch.optim.SGD(known.parameters(), lr=1.0), comm)
    outcome["optimizer has it"] = optimizer.gradient_compression is comm.gradient_compression

    # Bad input: a clear ValueError on every rank.
    outcome["errors"] = value_errors(
        (
            lambda: hooks.GradientCompressionState(threshold=0),
            lambda: hooks.GradientCompressionState(code="3bit"),
            lambda: torch_chainermn.create_communicator(gradient_compression={"code": "2bit", "thresh": 1}),
            lambda: compression.start([torch.ones(4, dtype=torch.int64)], ((0, 0, 4),)).wait(),
        )
    )
    comm.finalize()
    return outcome


def check(outcomes):
    for outcome in outcomes:
        assert all(outcome["hook"]) and outcome["hook rebuilt"], outcome["hook"]
        assert all(outcome["relayout"]), outcome["relayout"]
        assert all(outcome["double buffering"]), outcome["double buffering"]
        assert outcome["round trip"] and outcome["restored step"]
        assert outcome["communicator"] and outcome["optimizer has it"]
        threshold, kind, setting, dtype = outcome["errors"]
        assert "GradientCompressionState: threshold must be a positive finite number" in threshold
        assert "code must be one of" in kind
        assert "create_communicator: gradient_compression has unknown settings ['thresh']" in setting
        assert "gradient_compression: gradients must be floating point" in dtype


def test_hook_and_toolkit_two_ranks_as_two_nodes():
    check(run_spawn(process_cases, 2, env={"CHAINERMN_RANKS_PER_NODE": "1"}, timeout=240))


def test_hook_and_toolkit_two_nodes_of_two():
    check(run_spawn(process_cases, 4, env={"CHAINERMN_RANKS_PER_NODE": "2"}, timeout=360))


# ---- the block codes through the DDP hook, real processes -----------------------------------------


class OneVector(torch.nn.Module):
    """One parameter, so one bucket whatever DDP does: a block code's scales depend on where its blocks
    fall, and the reference lays the gradients out as this bucket does (the relayout of residuals is
    the same for every code: process_cases checks it with 2-bit)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(sum(SIZES.values())))

    def forward(self, grad):
        return (self.w * grad).sum()


def block_code_cases(kind: str, block: int, compress_result=False):
    """int8 / 4bit / topk through the DDP hook: 4 steps against the reference; a run resumed from
    state_dict(by_rank=True) after step 2 continues bit for bit; ranks that disagree on the block (and,
    for topk, on keep; with compressed sums, on their code) fail on every rank naming it, and the group
    goes on; bad settings."""
    rank = dist.get_rank()
    size = dist.get_world_size()
    per_node = torch_chainermn.topology().intra_size
    nodes = [list(range(n, n + per_node)) for n in range(0, size, per_node)]
    inputs = [[flat(gradients(r, step)) for r in range(size)] for step in range(4)]  # run() sends these
    expected = reference.compressed_mean_steps(inputs, nodes, 4, kind, compress_result=compress_result, block=block)[0]
    outcome = {}

    def run(model, state, steps):
        got = []
        for step in steps:
            model.zero_grad()
            model(flat(gradients(rank, step))).backward()
            got.append(model.module.w.grad.clone())
        return got

    model = DDP(OneVector())
    state = hooks.GradientCompressionState(code=kind, block=block, compress_result=compress_result)
    model.register_comm_hook(state, hooks.gradient_compression_hook)
    got = run(model, state, range(2))
    saved = state.state_dict(by_rank=True)
    got += run(model, state, range(2, 4))
    outcome["hook"] = [torch.equal(g, e) for g, e in zip(got, expected)]

    resumed_model = DDP(OneVector())
    resumed = hooks.GradientCompressionState(code=kind, block=block, compress_result=compress_result)
    resumed_model.register_comm_hook(resumed, hooks.gradient_compression_hook)
    run(resumed_model, resumed, [7])  # the run's layout, with other residuals: the load must replace them
    # The format of before residuals.py's, by_rank as [rank][layout], still loads (the new one: DiLoCo's tests).
    resumed.load_state_dict(
        {**saved, "by_rank": [[saved["by_rank"][k][r] for k in saved["by_rank"]] for r in range(size)]}
    )
    outcome["resumed"] = [torch.equal(g, e) for g, e in zip(run(resumed_model, resumed, range(2, 4)), expected[2:])]

    def disagreement(compression) -> tuple:
        """What a mean with settings that differ across ranks raised, and the next all_reduce's result."""
        try:
            compression.start([torch.ones(1000)], ((0, 0, 1000),)).wait()
            said = "completed"
        except ValueError as error:
            said = str(error)
        after = torch.ones(3)
        dist.all_reduce(after)
        return said, after.tolist()

    outcome["disagreement"], outcome["after"] = disagreement(
        GradientCompression(code=kind, block=block * (1 + rank % 2 * 2))
    )
    if kind == "topk":  # ranks that keep different numbers of values a block
        outcome["keep disagreement"], outcome["after keep"] = disagreement(
            GradientCompression(None, kind, block=block, keep=4 + rank % 2)
        )
    if compress_result:  # the sums in compress_result's code on one rank, in the type's own on the other
        outcome["sums disagreement"], outcome["after sums"] = disagreement(
            GradientCompression(None, kind, block=block, compress_result=compress_result if rank == 0 else True)
        )

    gloo = dist.new_group(backend="gloo")
    outcome["errors"] = value_errors(
        (
            lambda: hooks.GradientCompressionState(code=kind, block=0),
            lambda: hooks.GradientCompressionState(code="int4"),
            lambda: hooks.GradientCompressionState(gloo, code=kind),
            lambda: hooks.GradientCompressionState(code=kind, compress_result="2bit"),
        )
    )
    return outcome


@pytest.mark.parametrize(
    "kind, block, ranks_per_node, size, compress_result",
    [("int8", 64, "2", 4, False), ("4bit", 32, "1", 2, "int8"), ("topk", 64, "1", 2, False)],
    ids=["int8-2x2", "4bit-int8-sums-2x1", "topk-2x1"],
)
def test_block_codes_through_the_hook(kind, block, ranks_per_node, size, compress_result):
    outcomes = run_spawn(
        block_code_cases,
        size,
        kind,
        block,
        compress_result,
        env={"CHAINERMN_RANKS_PER_NODE": ranks_per_node},
        timeout=300,
    )
    for rank, outcome in enumerate(outcomes):
        assert all(outcome["hook"]), (rank, outcome["hook"])
        assert all(outcome["resumed"]), (rank, outcome["resumed"])
        assert "the block differs" in outcome["disagreement"], (rank, outcome["disagreement"])
        assert f"block={block}" in outcome["disagreement"] and f"block={3 * block}" in outcome["disagreement"]
        assert outcome["after"] == [float(size)] * 3
        if kind == "topk":
            assert "the keep differs" in outcome["keep disagreement"], (rank, outcome["keep disagreement"])
            assert "keep=4" in outcome["keep disagreement"] and "keep=5" in outcome["keep disagreement"]
            assert outcome["after keep"] == [float(size)] * 3
        if compress_result:
            said = outcome["sums disagreement"]
            assert "the compress_result differs" in said, (rank, said)
            assert f"compress_result={compress_result}" in said and f"compress_result={kind}" in said, said
            assert outcome["after sums"] == [float(size)] * 3
        block_error, type_error, group_error, sums_error = outcome["errors"]
        assert (
            "GradientCompressionState: compress_result must be True or a code that carries sums ('4bit', 'int8'), "
            "got '2bit'" in sums_error
        )
        assert "GradientCompressionState: block must be >= 1, got 0" in block_error
        assert f"GradientCompressionState: code must be one of {', '.join(map(repr, CODES))}, got 'int4'" in type_error
        assert "GradientCompressionState" in group_error and "chainermn" in group_error


def spelling_cases():
    """compression= is the one spelling of how a mean travels; the old ones still work, with a
    DeprecationWarning naming it, and both at once is refused."""
    import warnings

    outcome = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = hooks.DoubleBufferingState(compression=torch.float16)
        outcome["new spelling warns"] = [str(w.message) for w in caught]
        old = hooks.DoubleBufferingState(compress=torch.float16)
        comm = torch_chainermn.create_communicator("flat", gradient_compression={"code": "int8"})
        optimizer = torch_chainermn.create_multi_node_optimizer(
            torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0), gradient_compression={"code": "4bit"}
        )
        outcome["old spelling warns"] = [(w.category.__name__, str(w.message)) for w in caught]
    outcome["same mean"] = (new.mean.dtype, old.mean.dtype, comm.compression.code, optimizer.compression.code)
    # A CompressionSpec is a compression= value everywhere, and .compression the same kind of value.
    spec = torch_chainermn.CompressionSpec("4bit", block=64, compress_result="int8")
    model = torch.nn.Linear(2, 2)
    holders = {
        "double buffering": hooks.DoubleBufferingState(compression=spec),
        "communicator": torch_chainermn.create_communicator("flat", compression=spec),
        "optimizer": torch_chainermn.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=1.0), compression=spec
        ),
        "DiLoCo": torch_chainermn.DiLoCo(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.optim.SGD(model.parameters(), lr=0.7),
            sync_every=2,
            compression=spec,
        ),
        "state": hooks.GradientCompressionState(compression=spec),
    }
    outcome["specs"] = {
        name: (
            type(getattr(holder, "compression", holder)).__name__,
            getattr(holder, "compression", holder).spec == spec,
        )
        for name, holder in holders.items()
    }
    outcome["errors"] = value_errors(
        (
            lambda: hooks.DoubleBufferingState(compression=torch.float16, compress=torch.float16),
            lambda: torch_chainermn.create_communicator(compression=torch.float16),
            lambda: hooks.GradientCompressionState(compression=spec, block=32),
        )
    )
    # The code's one name is `code`: type= and {"type": ...} still work, warned, to the same settings.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = {
            "state": hooks.GradientCompressionState(code="int8", block=64),
            "double buffering": hooks.DoubleBufferingState(compression={"code": "int8", "block": 64}).compression,
            "DiLoCo": diloco({"code": "int8", "block": 64}, model).compression,
        }
        outcome["code warns"] = [str(w.message) for w in caught]
        kind = {
            "state": hooks.GradientCompressionState(type="int8", block=64),
            "double buffering": hooks.DoubleBufferingState(compression={"type": "int8", "block": 64}).compression,
            "DiLoCo": diloco({"type": "int8", "block": 64}, model).compression,
        }
        outcome["old property"] = kind["state"].type
        outcome["type warns"] = [(w.category.__name__, str(w.message)) for w in caught[len(outcome["code warns"]) :]]
    outcome["code kinds"] = {name: type(value).__name__ for name, value in code.items()}
    outcome["same settings"] = {name: code[name].settings() == kind[name].settings() for name in code}
    outcome["DiLoCo plain"] = [diloco(value, model).compression for value in (None, torch.float16)]
    # A checkpoint saved when the code's key was "type" loads.
    state = GradientCompression(code="int8", block=64)
    saved = state.state_dict()
    saved["settings"]["type"] = saved["settings"].pop("code")
    state.load_state_dict(saved)
    comm.finalize()
    holders["communicator"].finalize()
    return outcome


def diloco(compression, model):
    return torch_chainermn.DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(model.parameters(), lr=0.7),
        sync_every=2,
        compression=compression,
    )


def test_one_spelling_of_compression_the_old_ones_deprecated():
    outcome = run_spawn(spelling_cases, 1, timeout=120)[0]
    assert outcome["new spelling warns"] == [], outcome
    warned = outcome["old spelling warns"]
    assert [category for category, _ in warned] == ["DeprecationWarning"] * 3, warned
    for (_, message), op, old in zip(
        warned,
        ("DoubleBufferingState", "create_communicator", "create_multi_node_optimizer"),
        ("compress", "gradient_compression", "gradient_compression"),
    ):
        assert message == f"{op}: {old}= is deprecated, use compression= (it takes the same values)", warned
    assert outcome["same mean"] == (torch.float16, torch.float16, "int8", "4bit"), outcome
    for name, (kind, same) in outcome["specs"].items():
        assert kind in ("GradientCompression", "GradientCompressionState") and same, (name, kind)
    both, dtype, spec_and_setting = outcome["errors"]
    assert "compression= takes a torch_chainermn.CompressionSpec, which holds every setting" in spec_and_setting
    assert "['block']" in spec_and_setting, spec_and_setting
    assert "DoubleBufferingState: give compression= only (compress= is its old spelling), not both" in both, both
    assert "create_communicator: compression must be None or a hooks.GradientCompressionState" in dtype, dtype
    # The code's name: code=, {"code": ...}; the old type= and {"type": ...} warn, to the same settings.
    assert outcome["code warns"] == [], outcome
    assert outcome["type warns"] == [
        ("DeprecationWarning", "GradientCompressionState: type= is deprecated, use code= (it takes the same values)"),
        (
            "DeprecationWarning",
            'DoubleBufferingState: compression["type"] is deprecated, use compression["code"] (it takes the same values)',
        ),
        (
            "DeprecationWarning",
            'DiLoCo: compression["type"] is deprecated, use compression["code"] (it takes the same values)',
        ),
        ("DeprecationWarning", "GradientCompressionState.type is deprecated, use .code"),
    ], outcome
    assert outcome["old property"] == "int8"
    assert outcome["same settings"] == {"state": True, "double buffering": True, "DiLoCo": True}, outcome
    # .compression is the same kind of value everywhere: DiLoCo's is its GradientCompression, or None.
    assert outcome["code kinds"] == {
        "state": "GradientCompressionState",
        "double buffering": "GradientCompression",
        "DiLoCo": "GradientCompression",
    }, outcome
    assert outcome["DiLoCo plain"] == [None, None], outcome


def test_code_is_the_code_s_one_name_type_its_old_spelling():
    """In process, no group needed: the settings of {"type": ...} equal those of {"code": ...}, with a
    DeprecationWarning naming the new key; both spellings at once, as keywords or keys, are a ValueError
    naming the op; GradientCompression says `code` (SETTINGS, DEFAULTS)."""
    from torch_chainermn._means import compression_settings

    op = "torch_chainermn.fsdp.compress_between_nodes"
    with pytest.warns(
        DeprecationWarning, match=rf'^{op}: compression\["type"\] is deprecated, use compression\["code"\]'
    ):
        old = compression_settings({"type": "4bit", "block": 64}, op)
    assert old == compression_settings({"code": "4bit", "block": 64}, op)
    assert old["code"] == "4bit" and "type" not in old
    assert GradientCompression.SETTINGS[0] == "code" and GradientCompression.DEFAULTS["code"] == "2bit"
    both = [
        (lambda: GradientCompression(code="2bit", type="1bit"), "GradientCompression: give code= only (type= is"),
        (lambda: hooks.GradientCompressionState(code="2bit", type="2bit"), "GradientCompressionState: give code= only"),
        (
            lambda: compression_settings({"code": "int8", "type": "int8"}, "DiLoCo"),
            'DiLoCo: give compression["code"] only (compression["type"] is its old spelling), not both',
        ),
    ]
    for call, message in both:
        with pytest.raises(ValueError) as raised:
            call()
        assert str(raised.value).startswith(message), raised.value
