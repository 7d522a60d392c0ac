"""AllreducePersistent, the multi-node evaluator and the multi-node checkpointer, on real processes.

Two launches in all (each costs seconds): one where rank 1 dies in the middle of a save, and one that
runs every other check, starting with resuming from what the crashed launch left behind.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_chainermn.extensions as ext
from tests.support.harness import run_spawn


class Communicator:
    """Stands in for a torch_chainermn communicator: anything with a `group` attribute."""

    def __init__(self, group):
        self.group = group


def files_of(directory, name):
    return sorted(f for f in os.listdir(directory) if f.startswith(name + "."))


# ---- a rank dies in the middle of a save ---------------------------------------------------------


def crash_in_the_middle_of_a_save(directory):
    """Both ranks save iterations 1-3; during iteration 4 rank 1 dies after writing, before the rename."""
    rank = dist.get_rank()
    checkpointer = ext.create_multi_node_checkpointer("crash", None, cp_interval=2, gc_interval=100, path=directory)
    for iteration in (1, 2, 3):
        checkpointer.save({"iteration": iteration, "rank": rank, "values": torch.arange(1000.0)}, iteration)
    if rank == 1:

        def die(fd):  # the payload is written; the process dies before fsync and rename
            os._exit(17)

        os.fsync = die
    checkpointer.save({"iteration": 4, "rank": rank}, 4)
    return checkpointer.iterations()


def check_resume_after_crash(rank, directory):
    """A fresh launch resumes from iteration 3, the newest both ranks completed."""
    mine = files_of(directory, f"crash.{rank}")
    leftovers = [f for f in mine if ".tmp-" in f]
    assert len(leftovers) == (1 if rank == 1 else 0), mine
    assert (f"crash.{rank}.4" in mine) == (rank == 0), mine  # rank 1 died before its rename

    checkpointer = ext.create_multi_node_checkpoint("crash", None, cp_interval=2, gc_interval=1, path=directory)
    state, iteration = checkpointer.maybe_load()
    assert iteration == 3 and state["iteration"] == 3 and state["rank"] == rank, (iteration, state)
    assert torch.equal(state["values"], torch.arange(1000.0))
    assert checkpointer.loaded_iteration == 3
    checkpointer.save({"iteration": 4, "rank": rank}, 4)  # gc_interval=1: collects now
    dist.barrier()
    assert files_of(directory, f"crash.{rank}") == [f"crash.{rank}.3", f"crash.{rank}.4"]  # temp file gone
    checkpointer.finalize()
    dist.barrier()
    assert files_of(directory, "crash") == []


# ---- AllreducePersistent ---------------------------------------------------------------------------


def check_allreduce_persistent(rank, size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm1d(4).double()))
    model.register_buffer("halves", torch.full((5,), 1.5 + rank, dtype=torch.float16))
    model.register_buffer("counter", torch.tensor([10 + rank]))
    # Plain BatchNorm trained on different data gives every rank different statistics.
    model[:2](torch.randn(6, 3, generator=torch.Generator().manual_seed(rank)) * (rank + 1))
    model[2][0](torch.randn(5, 4, generator=torch.Generator().manual_seed(9 + rank), dtype=torch.float64))
    parameters = copy.deepcopy(list(model.parameters()))
    per_rank = [None] * size
    dist.all_gather_object(per_rank, {k: v.clone() for k, v in model.state_dict().items()})
    assert not torch.equal(per_rank[0]["1.running_mean"], per_rank[1]["1.running_mean"])

    average = ext.AllreducePersistent(model, Communicator(dist.group.WORLD))
    average()
    for key, value in model.state_dict().items():
        if "num_batches_tracked" in key or key == "counter":
            assert torch.equal(value, per_rank[rank][key]), key  # integers untouched
        elif "running" in key or key == "halves":
            expected = torch.stack([r[key].double() for r in per_rank]).mean(0).to(value.dtype)
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
            assert value.dtype == per_rank[rank][key].dtype
    # Parameters are not buffers: left alone.
    assert all(torch.equal(a, b) for a, b in zip(parameters, model.parameters()))
    # Every rank now holds the same buffers.
    gathered = [None] * size
    dist.all_gather_object(gathered, model.state_dict())
    assert all(torch.equal(gathered[0][k], gathered[-1][k]) for k in gathered[0] if k != "counter")
    with pytest.raises(ValueError, match="AllreducePersistent: model must be a torch.nn.Module"):
        ext.AllreducePersistent({"not": "a model"}, None)


# ---- evaluator ---------------------------------------------------------------------------------------


def shard(rank):
    """Uneven shards of a validation set: rank r holds 3 + 4r samples."""
    generator = torch.Generator().manual_seed(500 + rank)
    return torch.randn(3 + 4 * rank, generator=generator, dtype=torch.float64)


def check_evaluator(rank, size):
    data = shard(rank)
    everything = torch.cat([shard(r) for r in range(size)])

    def evaluate(offset=0.0):
        return {"loss": (data + offset).mean(), "maximum": float(data.max()), "count": len(data)}

    weighted = ext.create_multi_node_evaluator(evaluate, None, weight=len(data))
    metrics = weighted(offset=1.0)
    assert list(metrics) == ["loss", "maximum", "count"]  # this rank's order, floats
    assert all(isinstance(v, float) for v in metrics.values())
    assert abs(metrics["loss"] - (everything + 1.0).mean().item()) < 1e-12  # the whole set's mean
    assert metrics["count"] == sum(len(shard(r)) ** 2 for r in range(size)) / len(everything)

    # A callable weight, called after evaluate (here: it reads what evaluate recorded).
    seen = {}

    def evaluate_and_count():
        seen["samples"] = len(data)
        return {"loss": data.mean()}

    by_callable = ext.create_multi_node_evaluator(
        evaluate_and_count, Communicator(dist.group.WORLD), weight=lambda: seen["samples"]
    )
    assert abs(by_callable()["loss"] - everything.mean().item()) < 1e-12

    # Unweighted: ChainerMN's plain mean over ranks, which differs with uneven shards.
    plain = ext.create_multi_node_evaluator(evaluate, dist.group.WORLD)()
    expected = sum(shard(r).mean().item() for r in range(size)) / size
    assert abs(plain["loss"] - expected) < 1e-12 and abs(plain["loss"] - everything.mean().item()) > 1e-6

    # A rank of weight 0 (empty shard) adds nothing, even a NaN.
    empty = ext.create_multi_node_evaluator(
        lambda: {"loss": float("nan") if rank == 0 else data.mean()}, None, weight=0 if rank == 0 else 1
    )
    assert abs(empty()["loss"] - torch.stack([shard(r).mean() for r in range(1, size)]).mean().item()) < 1e-12

    # Different metric names on different ranks: every rank raises, none hangs.
    mismatched = ext.create_multi_node_evaluator(lambda: {"loss": 1.0, f"extra{rank % 2}": 2.0}, None)
    with pytest.raises(ValueError, match="same metric names"):
        mismatched()

    # evaluate failing on one rank: that rank raises its error, the others say where it failed.
    def flaky():
        if rank == 1:
            raise KeyError("shard missing")
        return {"loss": 0.0}

    if rank == 1:
        with pytest.raises(KeyError, match="shard missing"):
            ext.create_multi_node_evaluator(flaky, None)()
    else:
        with pytest.raises(RuntimeError, match="rank 1: KeyError"):
            ext.create_multi_node_evaluator(flaky, None)()
    for bad, words in [
        (lambda: ext.create_multi_node_evaluator(lambda: [1.0], None)(), "must return a dict"),
        (lambda: ext.create_multi_node_evaluator(lambda: {"v": torch.ones(2)}, None)(), "metric 'v'"),
        (lambda: ext.create_multi_node_evaluator(lambda: {"v": 1}, None, weight=-1)(), "weight must be finite"),
        (lambda: ext.create_multi_node_evaluator(lambda: {"v": 1}, None, weight=0)(), "sum to zero"),
        (lambda: ext.create_multi_node_evaluator("evaluate", None), "evaluate must be callable"),
        (lambda: ext.create_multi_node_evaluator(print, None, weight="many"), "weight must be None"),
    ]:
        with pytest.raises(ValueError, match=words):
            bad()
    check = torch.ones(1)
    dist.all_reduce(check)  # nothing left half-done
    assert check.item() == size


# ---- checkpointer ------------------------------------------------------------------------------------


def make_training(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train_epoch(model, optimizer, scheduler, epoch, rank, size):
    generator = torch.Generator().manual_seed(100 * epoch + rank)
    for _ in range(2):
        x = torch.randn(6, 4, generator=generator)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # the data-parallel gradient mean
            dist.all_reduce(p.grad)
            p.grad /= size
        optimizer.step()
    scheduler.step()


def state_of(model, optimizer, scheduler, epoch):
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
    }


def check_checkpoint_resume(rank, size, directory):
    total = 6
    uninterrupted = make_training(0)
    for epoch in range(1, total + 1):
        train_epoch(*uninterrupted, epoch, rank, size)

    # Train 4 epochs, saving each; cp_interval=2 and gc_interval=2: saves 2 and 4 collect.
    first = make_training(0)
    checkpointer = ext.create_multi_node_checkpointer("run", None, cp_interval=2, gc_interval=2, path=directory)
    assert checkpointer.maybe_load() == (None, 0)  # nothing yet
    for epoch in range(1, 5):
        train_epoch(*first, epoch, rank, size)
        checkpointer.save(state_of(*first, epoch), epoch)
    assert checkpointer.iterations() == [3, 4]
    dist.barrier()
    assert files_of(directory, "run") == [f"run.{r}.{i}" for r in range(size) for i in (3, 4)]

    # "Crash": everything is rebuilt from another seed, and a new checkpointer resumes.
    model, optimizer, scheduler = make_training(123)
    resumed = ext.create_multi_node_checkpointer(
        "run", Communicator(dist.group.WORLD), cp_interval=2, gc_interval=2, path=directory
    )
    state, start = resumed.maybe_load(map_location="cpu")
    assert start == 4 and state["epoch"] == 4
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for epoch in range(start + 1, total + 1):
        train_epoch(model, optimizer, scheduler, epoch, rank, size)
        resumed.save(state_of(model, optimizer, scheduler, epoch), epoch)
    for (name, a), b in zip(uninterrupted[0].state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name  # bit for bit the uninterrupted run
    assert scheduler.get_last_lr() == uninterrupted[2].get_last_lr()
    assert resumed.iterations() == [5, 6] and resumed.last_saved_iteration == 6
    resumed.finalize()
    dist.barrier()
    assert files_of(directory, "run") == []


def check_damaged_files(rank, size, directory):
    """A file cut short or with one flipped byte is never loaded: the previous common iteration is."""
    name = "damaged"
    checkpointer = ext.create_multi_node_checkpointer(name, None, cp_interval=10, gc_interval=100, path=directory)
    for iteration in (1, 2, 3):
        checkpointer.save(
            {"iteration": iteration, "rank": rank, "values": torch.full((256,), float(iteration))}, iteration
        )
    dist.barrier()
    if rank == 1:  # iteration 3 cut short on rank 1 only
        with open(checkpointer.filename(3), "r+b") as f:
            f.truncate(os.path.getsize(checkpointer.filename(3)) // 2)
        assert checkpointer.iterations() == [1, 2]
    if rank == 0:  # one flipped byte in the middle of rank 0's iteration 2: header and length intact
        with open(checkpointer.filename(2), "r+b") as f:
            f.seek(os.path.getsize(checkpointer.filename(2)) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        assert checkpointer.iterations() == [1, 2, 3]  # only the digest, checked on load, can tell
        # A valid file under another iteration's name is rejected too.
        with open(checkpointer.filename(1), "rb") as source, open(checkpointer.filename(7), "wb") as copy_:
            copy_.write(source.read())
        assert 7 not in checkpointer.iterations()
    dist.barrier()
    state, iteration = ext.create_multi_node_checkpointer(name, None, path=directory).maybe_load()
    assert iteration == 1 and state["iteration"] == 1 and state["rank"] == rank
    assert torch.equal(state["values"], torch.full((256,), 1.0))

    # Garbage collection removes the damaged files it can see (the truncated one).
    checkpointer.collect_garbage()
    assert checkpointer.iterations() == ([1, 2] if rank == 1 else [1, 2, 3])
    checkpointer.finalize()

    # Nothing in common: a fresh start. The path is created; the default path is the directory we are in.
    only_rank_0 = ext.create_multi_node_checkpointer("lonely", None, path=os.path.join(directory, "new", "dir"))
    if rank == 0:
        only_rank_0.save({"x": 1}, 5)
    assert only_rank_0.maybe_load() == (None, 0)
    only_rank_0.finalize()
    assert os.path.isdir(os.path.join(directory, "new", "dir"))
    here = os.getcwd()
    os.chdir(directory)
    try:
        assert ext.create_multi_node_checkpointer("cwd", None).path == os.path.realpath(directory)
    finally:
        os.chdir(here)
    for bad, words in [
        (lambda: ext.create_multi_node_checkpointer("a/b", None, path=directory), "name must be"),
        (lambda: ext.create_multi_node_checkpointer("", None, path=directory), "name must be"),
        (lambda: ext.create_multi_node_checkpointer("n", None, cp_interval=0, path=directory), "cp_interval"),
        (lambda: ext.create_multi_node_checkpointer("n", None, gc_interval=1.5, path=directory), "gc_interval"),
        (lambda: checkpointer.save({}, -1), "iteration must be an int >= 0"),
        (lambda: checkpointer.save({}, "3"), "iteration must be an int >= 0"),
    ]:
        with pytest.raises(ValueError, match=words):
            bad()
    dist.barrier()
    assert files_of(directory, name) == []  # finalize removed every file of ours, the misnamed copy too
    assert ext.create_multi_node_checkpoint is ext.create_multi_node_checkpointer


def extension_cases(directory):
    rank, size = dist.get_rank(), dist.get_world_size()
    check_resume_after_crash(rank, os.path.join(directory, "crash"))
    check_allreduce_persistent(rank, size)
    check_evaluator(rank, size)
    check_checkpoint_resume(rank, size, os.path.join(directory, "resume"))
    check_damaged_files(rank, size, os.path.join(directory, "damaged"))
    return True


def test_extensions(tmp_path):
    crash_directory = tmp_path / "crash"
    outcomes = run_spawn(crash_in_the_middle_of_a_save, 2, str(crash_directory), dies={1: "exit code 17"}, timeout=120)
    assert outcomes[0] == [1, 2, 3, 4] and outcomes[1] is None
    assert run_spawn(extension_cases, 2, str(tmp_path), timeout=240) == [True, True]
