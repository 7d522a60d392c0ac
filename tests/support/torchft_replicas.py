"""torchft replica groups as real processes that can be SIGKILLed and restarted (tests/test_torchft.py's
kill test and benchmarks/torchft_kills.py).

Layout: `replicas` replica groups of `ranks` processes each, on this machine, and a lighthouse
(torchft's LighthouseServer, min_replicas=1) in the controlling process. Each rank:

- joins its replica group's own process group (dist.init_process_group over the replica's TCPStore,
  hosted by the replica's rank 0; backend "chainermn" or "gloo");
- runs torchft's Manager (rank, world_size of the replica group, replica_id, the lighthouse) over
  torchft's reconfigurable process group, `ProcessGroupChainerMN` or torchft's `ProcessGroupGloo`:
  torchft makes one such group per group rank, across the replicas in the quorum (rank r of every
  replica), anew on every quorum;
- trains a small MLP with torchft's DistributedDataParallel (gradients averaged across the replicas
  in the quorum; its comm hook fixed for a failed allreduce, see `_fixed_ddp_class`) and
  OptimizerWrapper (SGD with momentum: the optimizer state is part of what a rejoining replica
  fetches); after backward, the replica's ranks average their gradients over the replica group
  (all_gather, summed in rank order).

The batch of a step depends only on the step number and the group rank, the same in every replica.
The replicas' average of identical gradients is exact (g+g)/2 = g, g/1 = g, g+0 = g (a healing
replica sends zeros), and the replica group's sum is in rank order, so every committed step applies
the same update as a plain replay of `steps` steps in one process (`replay`): a lost step, a step
applied twice, a rejoining replica that loaded stale weights or optimizer state, or replicas
averaging different steps' gradients all change the final parameters, bit for bit.

Each rank appends one JSON line per iteration to <out>/progress-r<replica>-i<incarnation>-g<rank>.jsonl
(step before and after, committed or not, the quorum id and participants, the wall time) and, at the
end, writes its parameters to final-...pt; its output goes to log-...txt. The controller
(`ReplicaGroups`) starts, holds (before a backward), kills (SIGKILL of every process of a replica,
from outside) and restarts replicas, reads the progress, and sets the step at which every rank
stops (<out>/stop).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path

from tests.support.harness import REPO, free_port

MODEL = {"inputs": 16, "hidden": 32, "classes": 4, "batch": 8, "lr": 0.05, "momentum": 0.9}


# ------------------------------------------------------------------------------------ the model


def make_model(model: dict):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(model["inputs"], model["hidden"]),
        torch.nn.ReLU(),
        torch.nn.Linear(model["hidden"], model["classes"]),
    )


def make_optimizer(model: dict, parameters):
    import torch

    return torch.optim.SGD(parameters, lr=model["lr"], momentum=model["momentum"])


def batch(model: dict, step: int, group_rank: int):
    """The batch of `step` for group rank `group_rank`: the same in every replica."""
    import torch

    generator = torch.Generator().manual_seed(step * 1009 + group_rank)
    return (
        torch.rand(model["batch"], model["inputs"], generator=generator),
        torch.randint(model["classes"], (model["batch"],), generator=generator),
    )


def sum_in_rank_order(rows):
    """rows[0] + rows[1] + ... in that order (what every rank of a replica computes, and the replay)."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total


def replay(model: dict, steps: int, ranks: int) -> list:
    """The parameters after `steps` committed steps, computed in one process: each step, every group
    rank's gradient on its batch, averaged in rank order, then one optimizer step."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (and 1 thread is 60x faster here than 2 on a busy machine)
    try:
        return _replay(model, steps, ranks)
    finally:
        torch.set_num_threads(threads)


def _replay(model: dict, steps: int, ranks: int) -> list:
    import torch

    net = make_model(model)
    optimizer = make_optimizer(model, net.parameters())
    for step in range(steps):
        flats = []
        for rank in range(ranks):
            optimizer.zero_grad()
            inputs, labels = batch(model, step, rank)
            torch.nn.functional.cross_entropy(net(inputs), labels).backward()
            flats.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        _set_grads(net, sum_in_rank_order(flats).div_(ranks))
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def _set_grads(net, flat) -> None:
    offset = 0
    for p in net.parameters():
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


# ------------------------------------------------------------------------------------ one rank


def _fixed_ddp_class():
    """torchft's DistributedDataParallel with its comm hook made to survive a failed allreduce.

    torchft 0.2.0's hook calls `work.wait()` on the Manager's _ManagedWork and returns
    `work.get_future()._fut`. When the process group's own wait() raises (a peer killed during the
    allreduce: chainermn's and Gloo's both raise there), _ManagedWork.wait() reports the error to the
    Manager (the step will not commit) and returns False before it sets `_fut`, so the hook's
    `assert fut._fut` raises AssertionError out of backward() and the surviving replica dies with
    the killed one. (With more than one bucket, a later bucket's allreduce returns a _DummyWork whose
    plain future has no `_fut` at all.) Here such a bucket is handed back as it is: the Manager knows
    the step failed and skips the optimizer step."""
    import torch
    from torchft.ddp import DistributedDataParallel

    class FixedDistributedDataParallel(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            inner = getattr(fut, "_fut", fut)
            if inner is None:  # wait() raised inside _ManagedWork.wait(); the Manager has the error
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
            return inner

    return FixedDistributedDataParallel


def rank_main(config: dict) -> None:
    """The body of one rank (a process of its own); exits 0 after the stop step, 1 on an error (its
    traceback in <out>/error-...txt)."""
    os.environ.update(config["env"])
    out = Path(config["out"])
    name = f"r{config['replica']}-i{config['incarnation']}-g{config['group_rank']}"
    # torchft's, torch's and the backends' messages go to the rank's log, not the controller's terminal.
    log = os.open(out / f"log-{name}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        _train(config, out, name)
    except BaseException:  # noqa: BLE001  the controller reads it
        (out / f"error-{name}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # torchft's and torch's threads must not hold the exit (the test checks the exit codes)


def _train(config: dict, out: Path, name: str) -> None:
    progress = open(out / f"progress-{name}.jsonl", "a", buffering=1)
    progress.write(json.dumps({"event": "entered", "t": time.time(), "pid": os.getpid()}) + "\n")
    import torch
    import torch.distributed as dist
    from torchft import Manager
    from torchft.optim import OptimizerWrapper

    torch.set_num_threads(1)
    backend, model_spec = config["backend"], config["model"]
    replica, rank, ranks = config["replica"], config["group_rank"], config["ranks"]
    timeout = timedelta(seconds=config["timeout_s"])
    if backend == "chainermn":
        import torch_chainermn  # noqa: F401  registers the backend
        from torch_chainermn.torchft import ProcessGroupChainerMN

        ft_pg = ProcessGroupChainerMN(timeout=timeout)
    else:
        from torchft.process_group import ProcessGroupGloo

        ft_pg = ProcessGroupGloo(timeout=timeout)

    # The replica group: its store (rank 0 hosts it) and its own process group.
    store = dist.TCPStore(
        "127.0.0.1", config["store_port"], ranks, is_master=rank == 0, wait_for_workers=False, timeout=timeout
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=ranks, timeout=timeout)
    progress.write(json.dumps({"event": "replica group", "t": time.time()}) + "\n")

    net = make_model(model_spec)
    inner = make_optimizer(model_spec, net.parameters())

    def state_dict():
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ft_pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=str(replica),
        store_addr="127.0.0.1",
        store_port=config["store_port"],
        rank=rank,
        world_size=ranks,
        lighthouse_addr=config["lighthouse"],
        port=0,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=config["quorum_timeout_s"]),
        connect_timeout=timeout,
        # Every replica starts from the same seeded weights, so no sync at step 0 (as torchft
        # advises). With it, when both replicas form the first quorum together, one of them
        # "heals" in each group rank's group, sends zeros, and is still counted in the
        # average: step 0's update is halved (the replay check caught it). A replica that
        # restarts behind the others heals as before.
        init_sync=False,
    )
    if config["torchft_ddp_as_is"]:
        from torchft.ddp import DistributedDataParallel
    else:
        DistributedDataParallel = _fixed_ddp_class()
    ddp = DistributedDataParallel(manager, net)
    optimizer = OptimizerWrapper(manager, inner)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch's new name
    stop_file, hold_file = out / "stop", out / f"hold-r{replica}"
    stop = None
    progress.write(json.dumps({"event": "manager", "t": time.time()}) + "\n")
    with progress:
        while True:
            if stop is None and stop_file.exists():
                text = stop_file.read_text().strip()
                stop = int(text) if text else None
            before = manager.current_step()
            if stop is not None and before >= stop:
                break
            if time.time() > config["deadline"]:
                raise RuntimeError(f"still training at step {before} at the deadline (stop step {stop})")
            optimizer.zero_grad()  # starts the quorum
            inputs, labels = batch(model_spec, before, rank)
            loss = torch.nn.functional.cross_entropy(ddp(inputs), labels)
            if hold_file.exists() and hold_file.read_text().strip() == str(before):
                # Every rank of this replica stops here, at the step the controller named; it kills them
                # while the other replicas wait for them in this step's allreduce.
                progress.write(json.dumps({"event": "holding", "t": time.time(), "step": before}) + "\n")
                while hold_file.exists():
                    time.sleep(0.01)
            # Before the backward whose allreduce waits for every replica of the quorum: the controller
            # knows a replica is in that step's exchange (ReplicaGroups.in_backward).
            progress.write(json.dumps({"event": "backward", "t": time.time(), "step": before}) + "\n")
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            gathered = torch.empty(ranks * flat.numel())
            all_gather_single(gathered, flat)
            _set_grads(net, sum_in_rank_order(list(gathered.view(ranks, -1))).div_(ranks))
            optimizer.step()  # should_commit, then the inner step if it says so
            after = manager.current_step()
            progress.write(
                json.dumps(
                    {
                        "t": time.time(),
                        "before": before,
                        "step": after,
                        "committed": after > before,
                        "quorum": manager._quorum_id,
                        "participants": manager.num_participants(),
                        "error": str(manager.errored()) if manager.errored() else None,
                    }
                )
                + "\n"
            )
    final = {
        "params": [p.detach().clone() for p in net.parameters()],
        "step": manager.current_step(),
        "shared_memory": _shared_memory(backend, ft_pg),
    }
    torch.save(final, out / f".final-{name}.tmp")
    os.rename(out / f".final-{name}.tmp", out / f"final-{name}.pt")
    # Rank 0 hosts the replica's store: the others must be done with it first.
    dist.barrier()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _shared_memory(backend: str, ft_pg) -> dict | None:
    """Whether both chainermn groups of this rank (its replica group's, torchft's current one) run
    their collectives through shared memory, and their sizes."""
    if backend != "chainermn":
        return None
    import torch
    import torch.distributed as dist
    from torch_chainermn._backend import backend_of

    replica_group = backend_of(None)
    quorum_group = ft_pg._pg._get_backend(torch.device("cpu"))
    return {
        "replica_group": (replica_group.shared_memory, replica_group.topology().intra_size, dist.get_world_size()),
        "torchft_group": (quorum_group.shared_memory, quorum_group.topology().intra_size, quorum_group.topology().size),
    }


# ------------------------------------------------------------------------------------ the controller


class ReplicaGroups:
    """Replica groups under one lighthouse: start, kill (SIGKILL from outside) and restart them, read
    their progress, stop them at a step, join them (killing what outlives the join's time)."""

    def __init__(
        self,
        out: Path,
        backend: str,
        replicas: int = 2,
        ranks: int = 2,
        heartbeat_timeout_ms: int = 2000,
        timeout_s: float = 10.0,
        quorum_timeout_s: float = 60.0,
        deadline_s: float = 600.0,
        model: dict | None = None,
        env: dict | None = None,
        start_method: str = "forkserver",
        torchft_ddp_as_is: bool = False,
    ) -> None:
        from torchft._torchft import LighthouseServer

        self.out, self.backend, self.replicas, self.ranks = Path(out), backend, replicas, ranks
        self.out.mkdir(parents=True, exist_ok=True)
        self.model = dict(MODEL, **(model or {}))
        self.env = {"OMP_NUM_THREADS": "1", "RUST_LOG": "warn", **(env or {})}
        self.timeout_s, self.quorum_timeout_s = timeout_s, quorum_timeout_s
        self.torchft_ddp_as_is = torchft_ddp_as_is
        self.deadline = time.time() + deadline_s
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=heartbeat_timeout_ms)
        self.context = mp.get_context(start_method)
        if start_method == "forkserver":
            # A restarted rank forks from a process that has imported these already: a restart costs
            # torchft's and the groups' setup, not the interpreter's start and torch's import.
            self.context.set_forkserver_preload(
                [
                    "torch",
                    "torch.distributed",
                    "torchft",
                    "torch_chainermn",
                    "torch_chainermn.torchft",
                    "tests.support.torchft_replicas",
                ]
            )
        self.incarnation = [-1] * replicas
        self.processes: dict[tuple[int, int], list] = {}  # (replica, incarnation) -> its processes
        self.started: dict[tuple[int, int], float] = {}
        self.killed: dict[tuple[int, int], float] = {}
        self._read: dict[Path, tuple[int, list]] = {}  # progress file -> (bytes parsed, its records)

    def start(self, replica: int) -> int:
        """Start a new incarnation of `replica` (new processes, same replica id); its number."""
        self.incarnation[replica] += 1
        incarnation = self.incarnation[replica]
        port = free_port()
        procs = []
        self.started[(replica, incarnation)] = time.time()
        for rank in range(self.ranks):
            config = {
                "replica": replica,
                "incarnation": incarnation,
                "group_rank": rank,
                "ranks": self.ranks,
                "store_port": port,
                "lighthouse": self.lighthouse.address(),
                "backend": self.backend,
                "model": self.model,
                "timeout_s": self.timeout_s,
                "quorum_timeout_s": self.quorum_timeout_s,
                "deadline": self.deadline,
                "out": str(self.out),
                "torchft_ddp_as_is": self.torchft_ddp_as_is,
                "env": {**self.env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
            }
            proc = self.context.Process(target=rank_main, args=(config,), name=f"replica{replica}-rank{rank}")
            proc.start()
            procs.append(proc)
        self.processes[(replica, incarnation)] = procs
        return incarnation

    def kill(self, replica: int) -> float:
        """SIGKILL every process of `replica`'s current incarnation; the time of the kill."""
        key = (replica, self.incarnation[replica])
        when = time.time()
        for proc in self.processes[key]:
            os.kill(proc.pid, signal.SIGKILL)
        for proc in self.processes[key]:
            proc.join(10)
        self.killed[key] = when
        (self.out / f"hold-r{replica}").unlink(missing_ok=True)
        return when

    def progress(self, replica: int, incarnation: int | None = None, rank: int = 0, events: bool = False) -> list[dict]:
        """The iterations `replica`'s rank has recorded so far (its current incarnation by default), or
        with `events` its setup's milestones (entered, replica group, manager)."""
        incarnation = self.incarnation[replica] if incarnation is None else incarnation
        path = self.out / f"progress-r{replica}-i{incarnation}-g{rank}.jsonl"
        if not path.exists():
            return []
        # Read on from where the last call stopped: a long run's files are polled often.
        offset, records = self._read.get(path, (0, []))
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read()
        complete = text[: text.rfind(b"\n") + 1]  # not a line still being written
        records = records + [json.loads(line) for line in complete.decode().splitlines() if line]
        self._read[path] = (offset + len(complete), records)
        return [r for r in records if ("event" in r) == events]

    def commits(self, replica: int, incarnation: int | None = None) -> list[dict]:
        return [r for r in self.progress(replica, incarnation) if r["committed"]]

    def step(self, replica: int) -> int:
        """The current incarnation's last committed step (0 before its first)."""
        commits = self.commits(replica)
        return commits[-1]["step"] if commits else 0

    def errors(self) -> str:
        """The tracebacks of the ranks that failed, each with the end of its log."""
        found = []
        for path in sorted(self.out.glob("error-*.txt")):
            log = path.with_name(path.name.replace("error-", "log-"))
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            found.append(f"{path.name}:\n{path.read_text()}\nthe end of its log:\n{tail}")
        return "\n".join(found)

    def wait_for(self, condition, timeout: float, what: str, poll: float = 0.05):
        """Poll `condition()` until it returns something true; fail after `timeout` s (or at once when a
        rank has failed)."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if self.errors():
                raise AssertionError(f"a rank failed while waiting for {what}:\n{self.errors()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not after {timeout:.0f} s")
            time.sleep(poll)

    def hold(self, replica: int, timeout: float = 30.0) -> int:
        """Make `replica`'s ranks stop before the backward of a step 2 past its last commit (all of
        them at the same step, so the other replicas wait for them in that step's allreduce); wait
        until all of them do. The step."""
        step = self.step(replica) + 2
        tmp = self.out / f".hold-r{replica}.tmp"
        tmp.write_text(str(step))
        os.rename(tmp, self.out / f"hold-r{replica}")

        def holding(rank):
            events = self.progress(replica, rank=rank, events=True)
            return events and events[-1]["event"] == "holding" and events[-1]["step"] == step

        self.wait_for(
            lambda: all(holding(rank) for rank in range(self.ranks)),
            timeout,
            f"replica {replica} holding at step {step}",
        )
        return step

    def in_backward(self, replica: int, step: int, timeout: float = 30.0) -> None:
        """Wait until every rank of `replica` has begun the backward of `step` (whose allreduce then
        waits for every replica in the quorum)."""

        def begun(rank):
            return any(
                e["event"] == "backward" and e["step"] == step for e in self.progress(replica, rank=rank, events=True)
            )

        self.wait_for(
            lambda: all(begun(rank) for rank in range(self.ranks)),
            timeout,
            f"replica {replica} in the backward of step {step}",
        )

    def stop_at(self, step: int) -> None:
        tmp = self.out / ".stop.tmp"
        tmp.write_text(str(step))
        os.rename(tmp, self.out / "stop")

    def running(self) -> list:
        return [(key, proc) for key, procs in self.processes.items() if key not in self.killed for proc in procs]

    def join(self, timeout: float) -> dict:
        """Wait for every running process; kill those still running after `timeout` s. Their exit codes,
        by (replica, incarnation, rank), and the ones that had to be killed."""
        deadline = time.monotonic() + timeout
        codes, hung = {}, []
        for (replica, incarnation), procs in self.processes.items():
            for rank, proc in enumerate(procs):
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    hung.append((replica, incarnation, rank))
                    proc.kill()
                    proc.join(5)
                codes[(replica, incarnation, rank)] = proc.exitcode
        return {"codes": codes, "hung": hung}

    def final(self, replica: int, incarnation: int, rank: int) -> dict:
        import torch

        return torch.load(self.out / f"final-r{replica}-i{incarnation}-g{rank}.pt")

    def close(self) -> None:
        for _, proc in self.running():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.lighthouse.shutdown()
