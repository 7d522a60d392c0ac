"""Running torchft's own test modules, as installed with torchft, on chainermn's torchft process
groups (tests/test_torchft_upstream.py).

torchft's cases build their reconfigurable groups by the names their modules imported from
torchft.process_group: `ProcessGroupGloo`, `ProcessGroupBabyGloo`. `on_chainermn(modules)` binds
those names, in those modules only, to chainermn's classes, so that the very same cases, unchanged,
run on chainermn. Every replica of torchft's integration tests is a thread of the test process, and a
"baby" group's subprocess is handed its class (one of these), so nothing is patched in another process.

This module stays light (it imports none of torchft's test modules): a baby group's subprocess
imports it to find its class.
"""

from __future__ import annotations

import collections
import glob
import re
import time
from contextlib import ExitStack, contextmanager
from unittest import mock

from torchft.manager import Manager

from torch_chainermn.torchft import ProcessGroupBabyChainerMN, ProcessGroupChainerMN

# A baby group's start: a fresh interpreter that imports torch, torchft and torch_chainermn and makes
# the group, three of them at once in torchft's cases, against the 10 s torchft's cases allow it. On
# this project's 2-core machine, idle: 5 to 6 s (torchft's own gloo class: 4 s); busy with other
# work: 10 to 17 s, and torchft's gloo class missed its 10 s too.
BABY_START_S = 60.0


class ProcessGroupBabyChainerMNStart(ProcessGroupBabyChainerMN):
    """ProcessGroupBabyChainerMN whose subprocess may take BABY_START_S to start (see above); every
    op keeps the timeout torchft's case gives the group."""

    def configure(self, *args, **kwargs) -> None:
        timeout = self._timeout  # what configure() waits for the subprocess's group, then each op's
        self._timeout = max(timeout, BABY_START_S)
        try:
            super().configure(*args, **kwargs)
        finally:
            self._timeout = timeout


class ManagerOnAnyPort(Manager):
    """torchft's Manager, its server on a port the system picks: torchft's integration tests bind
    19530 + the replica id, which another run of this suite on the same machine (a developer's beside
    CI's) may hold at that moment."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["port"] = 0
        super().__init__(*args, **kwargs)


SUBSTITUTES = {
    "ProcessGroupGloo": ProcessGroupChainerMN,
    "ProcessGroupBabyGloo": ProcessGroupBabyChainerMNStart,
    "Manager": ManagerOnAnyPort,
}


@contextmanager
def on_chainermn(*modules):
    """While inside: `modules` (torchft's test modules) construct chainermn's groups where they
    construct gloo's, and their Managers listen on free ports."""
    with ExitStack() as stack:
        for module in modules:
            for name, ours in SUBSTITUTES.items():
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, ours))
        yield


def abandoned_workers() -> int:
    """chainermn worker threads of this process whose group is gone. A live group has a worker and a
    watchdog thread; destroying a group stops both, but detaches a worker still inside a transport
    call, which returns at the op's deadline."""
    names = collections.Counter()
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as comm:
                names[comm.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    return names["cmn-worker"] - names["cmn-watchdog"]


def wait_for_abandoned_workers(limit_s: float) -> None:
    """Waits (up to limit_s) until no chainermn worker is left inside an abandoned op.

    torchft's resiliency cases run every rank as a thread of this process, so a survivor's shared
    memory transport cannot see its lost peer's process die (it is its own), and the op it was in
    stays in the transport until the group timeout (30 s there), its group aborted and destroyed
    meanwhile. Such a worker then lets go of the op's tensors, which takes the GIL: were the
    interpreter finalizing at that moment (this module ends the suite but for a second of tests),
    the process would abort ("terminate called without an active exception")."""
    deadline = time.monotonic() + limit_s
    while abandoned_workers() > 0 and time.monotonic() < deadline:
        time.sleep(0.2)


def only(*patterns: str):
    """Class decorator for a subclass of one of torchft's TestCases: keeps the cases whose names match
    one of `patterns` (re.fullmatch; parameterized's names carry an index that changes from run to
    run, e.g. test_collective_3_allreduce) and hides the others from pytest. A pattern that matches
    no case is an error, so that a torchft release that renames its cases cannot quietly run none."""

    def keep(cls):
        names = [name for name in dir(cls) if name.startswith("test") and callable(getattr(cls, name))]
        unmatched = [p for p in patterns if not any(re.fullmatch(p, name) for name in names)]
        if unmatched:
            raise LookupError(f"{cls.__name__}: no torchft case matches {unmatched} (cases: {names})")
        for name in names:
            if not any(re.fullmatch(p, name) for p in patterns):
                setattr(cls, name, None)
        return cls

    return keep


# process_group_test's resiliency case (MultiPgBaseTest._run_with_resiliency) lists the failures it
# accepts on the survivors: gloo's and NCCL's words for a peer that left, and timeouts.
UPSTREAM_PEER_LEFT = re.compile(r"Connection closed by peer")
# chainermn's words for a peer that left: it aborted its group (ProcessGroupChainerMN.shutdown()), or
# its process is gone (a baby group's subprocess, killed by ProcessGroupBaby.shutdown()).
CHAINERMN_PEER_LEFT = (
    r"the group was aborted: rank \d+ aborted the group \(ProcessGroup\.abort\(\)\)"
    r"|rank \d+ \(host [^,]+, pid \d+\) died"
)


class ChainerMNFailureTexts:
    """Mixin for the subclasses of torchft's MultiPgBaseTest. Its resiliency case checks the
    survivors' error against a list of gloo's and NCCL's messages that also takes "no error" (the op
    completed) and "timed out after"; there, and only there, the list is replaced by chainermn's
    messages for a peer that left: the survivors' collective must fail naming the lost rank, neither
    complete nor wait it out. The one exception is send/recv, a transfer between ranks 0 and 1 that
    the lost rank 2 takes no part in: it must complete ("no error"), and fail in no other way."""

    def assertRaisesRegex(self, expected_exception, expected_regex, *args, **kwargs):
        if isinstance(expected_regex, str) and UPSTREAM_PEER_LEFT.search(expected_regex):
            expected_regex = "no error" if "send_recv" in self._testMethodName else CHAINERMN_PEER_LEFT
        return super().assertRaisesRegex(expected_exception, expected_regex, *args, **kwargs)
