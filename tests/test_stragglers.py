"""Stragglers named (docs/observability.md#stragglers): every rank learns every rank's time in its
previous collective through the collectives' own cross-rank checks, and from that who arrived last
and by how much. Real ranks: one that sleeps 10 ms before each collective is named within 20
collectives, on every rank, and rank 0 logs one line naming it and its node; before it starts
sleeping nobody is named. On one node (the check rides in the shared-memory barrier) and on two
simulated nodes (the check goes through the levels: the node, then across nodes). In process: the
merge of the ranks' times through overlapping sets of ranks (as the levels see them), and the rule
that names a rank, on times the test chooses."""

import os
import random
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from tests.support.harness import run_spawn
from torch_chainermn._C import testing

QUIET_OPS = 20  # collectives before the sleeper starts: nobody may be named
SLEEPY_OPS = 20  # the sleeper must be named within these
SLEEP_S = 0.010
# The margin these tests name a rank by: above the default 5 ms, because this shared 2-core machine
# (load 15: other sessions building) once made a rank that does not sleep arrive 5 ms late on average
# in most of a window, by scheduling alone; 8 ms still names the 10 ms sleeper within 20 collectives.
MARGIN = {"CHAINERMN_STRAGGLER_MARGIN_MS": "8"}


def named_when_one_sleeps(sleeper):
    rank = dist.get_rank()
    x = torch.ones(1024)
    dist.all_reduce(x)  # from here on every collective learns its predecessor's times
    observed_before = torch_chainermn.stragglers()["observed"]
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 2)  # the backend's warning goes to this process's stderr
        try:
            named_while_quiet = []
            for _ in range(QUIET_OPS):
                dist.all_reduce(x)
                named_while_quiet.append(torch_chainermn.stragglers()["straggler"])
            quiet_log_end = log.seek(0, os.SEEK_END)
            named_after = None
            for op in range(1, SLEEPY_OPS + 1):
                if rank == sleeper:
                    time.sleep(SLEEP_S)
                dist.all_reduce(x)
                if named_after is None and torch_chainermn.stragglers()["straggler"] is not None:
                    named_after = op
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read()
    summary = torch_chainermn.stragglers()
    summary["observed"] -= observed_before
    return {
        "named_while_quiet": [n for n in named_while_quiet if n is not None],
        "named_after": named_after,
        "summary": summary,
        "quiet_log": text[:quiet_log_end],
        "log": text,
    }


def check(results, sleeper, node):
    for rank, out in enumerate(results):
        summary = out["summary"]
        assert out["named_while_quiet"] == [], (rank, out["named_while_quiet"])
        assert out["named_after"] is not None and out["named_after"] <= SLEEPY_OPS, (rank, out["named_after"])
        assert summary["straggler"] == sleeper, (rank, summary)
        late = summary["ranks"][sleeper]
        assert late["node"] == node, (rank, late)
        assert 4 * late["last"] >= 3 * summary["window"], (rank, summary)
        # Slept 10 ms before each: it arrived about that long after the others (scheduling adds, never takes).
        assert summary["margin_ms"] == 8.0 <= late["mean_ms"] <= late["max_ms"], (rank, late)
        assert summary["observed"] == QUIET_OPS + SLEEPY_OPS, (rank, summary)  # each learnt at the next
    lines = [line for line in results[0]["log"].splitlines() if "straggler" in line]
    assert len(lines) == 1, results[0]["log"]
    assert f"rank {sleeper} (node {node})" in lines[0], lines
    assert "straggler" not in results[0]["quiet_log"]
    for out in results[1:]:
        assert "straggler" not in out["log"], out["log"]  # rank 0 alone logs


def test_a_sleeping_rank_is_named_on_one_node():
    results = run_spawn(named_when_one_sleeps, 2, 1, env={"CHAINERMN_HOSTNAME": "only-node", **MARGIN})
    check(results, sleeper=1, node="only-node")


def test_a_sleeping_rank_is_named_across_simulated_nodes():
    results = run_spawn(named_when_one_sleeps, 4, 3, env={"CHAINERMN_RANKS_PER_NODE": "2", **MARGIN}, timeout=240)
    check(results, sleeper=3, node="simulated-node-1")


def test_times_merged_through_overlapping_sets_name_the_shortest_and_the_next():
    rng = random.Random(59)
    for _ in range(500):
        nodes, per_node = rng.randint(1, 4), rng.randint(1, 4)
        size = nodes * per_node
        micros = [rng.randint(0, 20) for _ in range(size)]  # small: ties are common
        if rng.random() < 0.1:
            micros[rng.randrange(size)] = None  # a rank whose last collective was not timed
        # As the levels see them: each rank merges its node and its place across nodes, then a
        # node's ranks merge what they saw.
        node = [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
        across = [list(range(i, size, per_node)) for i in range(per_node)]
        sets = [s for i in range(per_node) for s in (node[0], across[i])]
        last, shortest, next_shortest, unmeasured = testing.merged_arrival(micros, sets)
        if None in micros:
            assert unmeasured, (micros, sets)
            continue
        least = min(micros)
        expected_last = micros.index(least)  # the lowest rank among equals
        others = [m for r, m in enumerate(micros) if r != expected_last]
        assert (last, shortest, next_shortest, unmeasured) == (
            expected_last,
            least,
            min(others) if others else -1,
            False,
        ), (micros, sets)


def test_a_rank_is_named_when_last_in_three_quarters_of_the_window_by_the_margin():
    late, early = (1, 10_000), (0, 100)  # (last rank, microseconds after every other rank)
    # Window 4: named at the third time in the window (3 of 4), no longer once one leaves it.
    assert testing.stragglers_named(2, 4, 5.0, [late, early, late, late, early, early]) == [-1, -1, -1, 1, -1, -1]
    # Last every time, but by 1 ms on average: under the 5 ms margin.
    assert testing.stragglers_named(2, 4, 5.0, [(1, 1000)] * 6) == [-1] * 6
    # Window 8: last in 5 of 8 (more than half) is not enough; in 6 of 8 it is.
    assert testing.stragglers_named(2, 8, 5.0, [early, late, late, early, late, late, late, late])[-2:] == [-1, 1]
    # The mean decides: 2 ms, 2 ms and 12 ms average 5.3 ms.
    assert testing.stragglers_named(3, 4, 5.0, [(2, 2000), (2, 2000), (2, 12_000)]) == [-1, -1, 2]


def test_the_settings_are_read_and_checked(monkeypatch):
    from torch_chainermn import settings

    for name in ("CHAINERMN_STRAGGLER_WINDOW", "CHAINERMN_STRAGGLER_MARGIN_MS", "CHAINERMN_STRAGGLER_WARN"):
        monkeypatch.delenv(name, raising=False)
    assert settings.stragglers() == (16, 5.0, True)
    monkeypatch.setenv("CHAINERMN_STRAGGLER_WINDOW", "32")
    monkeypatch.setenv("CHAINERMN_STRAGGLER_MARGIN_MS", "2.5")
    monkeypatch.setenv("CHAINERMN_STRAGGLER_WARN", "0")
    assert settings.stragglers() == (32, 2.5, False)
    for name, bad in (
        ("CHAINERMN_STRAGGLER_WINDOW", "1"),
        ("CHAINERMN_STRAGGLER_MARGIN_MS", "-1"),
        ("CHAINERMN_STRAGGLER_MARGIN_MS", "nan"),
        ("CHAINERMN_STRAGGLER_WARN", "yes"),
    ):
        with monkeypatch.context() as m:
            m.setenv(name, bad)
            with pytest.raises(ValueError, match=f"{name} must be"):
                settings.stragglers()


def nothing_learnt_with_the_checks_off():
    x = torch.ones(1024)
    for _ in range(QUIET_OPS):
        if dist.get_rank() == 1:
            time.sleep(SLEEP_S)
        dist.all_reduce(x)
    return torch_chainermn.stragglers(), torch_chainermn.counters()["ops"]


def test_with_the_checks_off_nothing_is_learnt():
    """The times ride in the checks' fingerprints: with the checks off nothing is exchanged (the
    counters, which need no exchange, still count)."""
    for summary, ops in run_spawn(nothing_learnt_with_the_checks_off, 2, env={"TORCH_DISTRIBUTED_DEBUG": "OFF"}):
        assert summary["observed"] == 0 and summary["straggler"] is None, summary
        assert ops >= QUIET_OPS, ops
