"""torchft's own tests, from the installed torchft package, on chainermn's torchft process groups
(torch_chainermn.torchft) where torchft runs them on gloo's.

Nothing of torchft's is copied: each class below subclasses one of torchft's TestCases, so pytest
runs torchft's cases as they are, while tests/support/torchft_upstream.py binds the names they build
their groups by (ProcessGroupGloo, ProcessGroupBabyGloo) to ProcessGroupChainerMN and
ProcessGroupBabyChainerMN. Three allowances besides, each explained there: the survivors of the
resiliency case may also fail with chainermn's words for a peer that left (torchft lists gloo's and
NCCL's); a baby group's subprocess may take 60 s to start (torchft allows 10 s, which this 2-core
machine misses at times with torchft's own gloo class too); the Managers listen on free ports.

The cases, chosen to fit about 90 s on a 2-core machine (each also passes on torchft's own gloo
classes here):
- process_group_test, ProcessGroupChainerMN (3 ranks, threads of this process): every case of
  torchft's gloo class, collectives (all_gather, all_gather_into_tensor_coalesced, all_reduce,
  all_reduce_coalesced, barrier, broadcast, broadcast_one, send/recv) and resiliency (the last rank
  leaves its group in the middle; the others' next op must fail, on chainermn naming it).
- process_group_test, ProcessGroupBabyChainerMN (each rank's group in a subprocess of its own): every
  collective case, and the resiliency case of all_reduce only: each resiliency case starts three
  new subprocesses (about 10 s here), and ProcessGroupChainerMN's cases above cover every op.
- manager_integ_test (two replicas under torchft's Manager and lighthouse): test_ddp_healthy,
  test_ddp_recovery (async and sync quorum: a replica fails at step 2, restarts and recovers the
  other's state), test_ddp_recovery_multi_rank (replicas of two ranks: two torchft groups at once)
  and test_manager_allreduce (CPU).
- local_sgd_integ_test: test_local_sgd_recovery, test_diloco_healthy, test_diloco_recovery,
  test_streaming_diloco_recovery (two fragments, their all_reduces in flight while training goes on)
  and one of the 12 configurations of test_streaming_diloco_commit_failure (a failed all_reduce
  injected on each replica), the richest: 2 fragments, a sync delay of 1, alpha 1.0.
Not run: ProcessGroupTest's single-rank cases (no peer; gloo's own timeouts and APIs), the NCCL,
XCCL and torchcomms cases (no GPU here), test_quorum_timeout (no op on the group),
test_ddp_skip_init_sync (test_ddp_healthy's ops), test_streaming_diloco_upscale (a third replica
joining: its quorum times out now and then on this machine on gloo too) and the other
commit-failure configurations (the same ops with other fragment settings).
"""

import pytest

# torchft's test modules, from the installed package (they need `parameterized`, torchft's test
# dependency, which the Makefile installs). Imported as modules, so that pytest collects only our
# subclasses of their TestCases, not theirs.
from torchft import local_sgd_integ_test, manager_integ_test, process_group_test  # noqa: E402
from torchft._test import diloco_trainer  # noqa: E402  (builds the DiLoCo cases' groups)

from tests.support import torchft_upstream as upstream  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def torchft_tests_on_chainermn():
    """chainermn's groups in torchft's test modules while this module's tests run, and only then (a
    module-scoped fixture is set up before the classes' setUpClass, which makes their groups). At
    the end, the workers the resiliency cases left in their ops are let finish (see
    wait_for_abandoned_workers; the cases after those take most of that time)."""
    with upstream.on_chainermn(process_group_test, manager_integ_test, local_sgd_integ_test, diloco_trainer):
        yield
    upstream.wait_for_abandoned_workers(limit_s=40)


@upstream.only(r"test_collective_\d+_.+", r"test_collective_with_resiliency_\d+_.+")
class TestChainerMNMultiPg(upstream.ChainerMNFailureTexts, process_group_test.NormalGlooMultiPgTest):
    """torchft's NormalGlooMultiPgTest on ProcessGroupChainerMN: each collective gives the expected
    values on 3 ranks; in each resiliency case the group is reconfigured (a new chainermn group), one
    collective passes, then rank 2 shuts its group down and ranks 0 and 1 must see their next op fail
    with a peer-left error (and errored() say "aborted"), not complete and not time out; their
    send/recv, which rank 2 takes no part in, completes."""


@upstream.only(r"test_collective_\d+_.+", r"test_collective_with_resiliency_\d+_allreduce")
class TestChainerMNBabyMultiPg(upstream.ChainerMNFailureTexts, process_group_test.BabyGlooMultiPgTest):
    """torchft's BabyGlooMultiPgTest on ProcessGroupBabyChainerMN (each rank's chainermn group in a
    subprocess): each collective gives the expected values through the subprocesses; in the
    resiliency case rank 2 kills its subprocess (torchft's shutdown()) and ranks 0 and 1's next
    all_reduce must fail within their 1 s timeout."""


@upstream.only(
    "test_ddp_healthy",
    r"test_ddp_recovery_\d+_(async|sync)_quorum",
    "test_ddp_recovery_multi_rank",
    "test_manager_allreduce_1",
)
class TestChainerMNManagerInteg(manager_integ_test.ManagerIntegTest):
    """torchft's ManagerIntegTest on ProcessGroupChainerMN: replicas that train torchft's DDP under its
    Manager and lighthouse end with the same model and optimizer state, also when one replica (of one
    rank, or of two) fails at step 2 and starts again (the failure counted once); the Manager's
    all_reduce of two replicas gives the same result on both."""


@upstream.only(
    "test_local_sgd_recovery_0",
    "test_diloco_healthy_0",
    "test_diloco_recovery_0",
    "test_streaming_diloco_recovery_0",
    "test_streaming_diloco_commit_failure_11",
)
class TestChainerMNLocalSGDInteg(local_sgd_integ_test.LocalSGDIntegTest):
    """torchft's LocalSGDIntegTest on ProcessGroupChainerMN: under LocalSGD, a replica that fails at
    step 2 and recovers ends with the other's model; under DiLoCo (one fragment, or two streamed),
    healthy or with such a failure, or with an injected failed all_reduce, both replicas end every
    sync with the same global model and outer optimizer state."""
