"""LocalSGD and DiLoCo (torch_chainermn.local_sgd) on real ranks: see tests/support/local_sgd_cases.py."""

from tests.support import local_sgd_cases
from tests.support.harness import run_spawn


def test_two_ranks_as_two_nodes():
    """DDP's steps with every step synced (DiLoCo from replicas equal by seed: start="same"); the rules'
    reference (float32, and 2-bit streaming); eager updates against their reference (float32, 2-bit with two
    fragments); bad input raises the same clear ValueError on every rank,
    replicas that do not start equal under start="same" included."""
    outcomes = run_spawn(local_sgd_cases.two_nodes_of_one, 2, env={"CHAINERMN_RANKS_PER_NODE": "1"}, timeout=240)
    expected = [
        "DiLoCo: sync_every must be an int >= 1, got 0",
        "LocalSGD: sync_every must be an int >= 1, got 0",
        "DiLoCo: fragments must be an int >= 1, got 0",
        "DiLoCo: fragments must be at most the number of trainable parameters (4), got 5",
        "DiLoCo: fragment_delay must be below sync_every / fragments (4 / 2), got 2",
        "DiLoCo: outer_optimizer must hold the model's trainable parameters and no others",
        "DiLoCo: compression must be None, torch.float16, torch.bfloat16 or a GradientCompression",
        "DiLoCo: ranks disagree on the model's params",
        "DiLoCo: sync_every must be an int >= 1, got 0 (on rank 1)",
        "DiLoCo: ranks disagree on the model's settings: fragment_delay=1 on rank 0, fragment_delay=0 on rank 1",
        "DiLoCo: warmup_steps must be an int >= 0, got -1",
        "DiLoCo: start must be one of ('broadcast', 'same'), got 'rank0'",
        "DiLoCo: ranks disagree on the model's values (start='same': they must start equal): #3 ('2.bias', ",
        "LocalSGD: ranks disagree on the model's values (start='same': they must start equal): #3 ('2.bias', ",
        "DiLoCo: eager=True keeps each exchange in flight for a whole round (sync_every steps): fragment_delay "
        "must be 0, got 1",
        "DiLoCo: eager must be True or False, got 'yes'",
        "DiLoCo: ranks disagree on the model's settings: eager=True on rank 0, eager=False on rank 1",
    ]
    for rank, errors in enumerate(outcomes):
        assert len(errors) == len(expected), errors
        for got, want in zip(errors, expected):
            assert want in got, f"rank {rank}: {got!r} does not say {want!r}"


def test_two_nodes_of_two():
    """The reference for H=3, F=1/2, tau=0/1, float32 and 2-bit, with buffers, with and without a warm
    start; checkpoints mid-run (between syncs, a fragment in flight, through torch.distributed.checkpoint,
    during the warm start) resume bit for bit; eager updates against their reference (buffers, 2-bit with two
    fragments, a warm start) and resumed bit for bit with an exchange in flight (float32, 4-bit, top-k);
    one replica per node (DDP over node_group()), eager too (M = the number of nodes)."""
    run_spawn(local_sgd_cases.two_nodes_of_two, 4, env={"CHAINERMN_RANKS_PER_NODE": "2"}, timeout=360)
