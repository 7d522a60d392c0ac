"""torch_chainermn.torchft: torchft's reconfigurable process groups on chainermn (torchft is installed
for the tests by `make install`): a quorum's group works, a new quorum rebuilds it, a replica that
torchft aborts is named on its peers at once, and torchft's Manager trains DDP replicas on it."""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.support.harness import run_spawn


def replica_groups(wrapper_name: str):
    """Each rank a replica: two quorums' groups (torchft's configure, as its Manager calls it on each
    quorum), an all_reduce in each; then replica 1 aborts (torchft's way to end a failed replica's
    group) while replica 0 waits in an all_reduce."""
    import torch_chainermn.torchft as ft

    rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)  # noqa: F841
    pg = getattr(ft, wrapper_name)(timeout=timedelta(seconds=30))
    sums = []
    for quorum in (1, 2):
        pg.configure(f"127.0.0.1:{port}/torchft/{quorum}", f"replica_{rank}", rank, 2)
        value = torch.full((100,), float(rank + 1))
        pg.allreduce([value], dist.ReduceOp.SUM).wait()
        sums.append(value[0].item())
    outcome = {"sums": sums, "name": pg.getBackendName()}
    if wrapper_name != "ProcessGroupChainerMN":
        return outcome
    outcome["errored before"] = pg.errored()
    if rank == 1:
        time.sleep(0.5)
        pg.abort()
    else:
        try:
            pg.allreduce([torch.ones(10)], dist.ReduceOp.SUM).wait()
            outcome["after abort"] = "completed"
        except Exception as error:  # noqa: BLE001  torchft passes the backend's error on
            outcome["after abort"] = str(error)
        outcome["errored after"] = str(pg.errored())
    return outcome


def test_torchft_process_groups_on_chainermn():
    """ProcessGroupChainerMN: two quorums, each all_reduce right; replica 1's abort fails replica 0's
    pending all_reduce with the abort's reason (its timeout is 30 s), and errored() then says it
    (None before). ProcessGroupBabyChainerMN (the
    group in a subprocess): two quorums, each all_reduce right."""
    outcomes = run_spawn(replica_groups, 2, "ProcessGroupChainerMN", init=False, timeout=120)
    for outcome in outcomes:
        assert outcome["sums"] == [3.0, 3.0] and outcome["name"] == "torchft-chainermn", outcome
    said = "rank 1 aborted the group (ProcessGroup.abort())"
    assert said in outcomes[0]["after abort"] and said in outcomes[0]["errored after"], outcomes[0]
    assert outcomes[0]["errored before"] is None and outcomes[1]["errored before"] is None, outcomes
    babies = run_spawn(replica_groups, 2, "ProcessGroupBabyChainerMN", init=False, timeout=120)
    for outcome in babies:
        assert outcome["sums"] == [3.0, 3.0] and outcome["name"] == "torchft-baby-chainermn", outcome


def managed_ddp_replica(lighthouse: str):
    """One replica group of one rank: torchft's Manager (quorums through the lighthouse) over
    ProcessGroupChainerMN, torchft's DDP and OptimizerWrapper, 5 steps; its final parameters."""
    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from torch_chainermn.torchft import ProcessGroupChainerMN

    replica = int(os.environ["RANK"])
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = None

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupChainerMN(timeout=timedelta(seconds=30)), min_replica_size=2,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=str(replica),
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, port=0, timeout=timedelta(seconds=30))
    try:
        ddp = DistributedDataParallel(manager, model)
        optimizer = OptimizerWrapper(manager, torch.optim.SGD(ddp.parameters(), lr=0.1))
        generator = torch.Generator().manual_seed(replica)
        while manager.current_step() < 5:
            optimizer.zero_grad()
            inputs, labels = torch.rand(4, 3, generator=generator), torch.randint(4, (4,), generator=generator)
            torch.nn.functional.cross_entropy(ddp(inputs), labels).backward()
            optimizer.step()
        moved = max((p.detach() - s).abs().max().item() for p, s in zip(model.parameters(), start))
        return {"parameters": [p.detach().clone() for p in model.parameters()], "moved": moved,
                "step": manager.current_step()}
    finally:
        manager.shutdown(wait=False)


def test_torchft_manager_trains_ddp_replicas_on_chainermn():
    """Two replica groups under torchft's Manager and lighthouse, the quorum's group a chainermn one:
    5 steps of torchft's DDP; both replicas end with the same parameters, moved from the start."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        outcomes = run_spawn(managed_ddp_replica, 2, lighthouse.address(), init=False, timeout=180)
    finally:
        lighthouse.shutdown()
    for outcome in outcomes:
        assert outcome["step"] >= 5 and outcome["moved"] > 1e-3, outcome
    assert all(torch.equal(a, b) for a, b in zip(outcomes[0]["parameters"], outcomes[1]["parameters"]))
