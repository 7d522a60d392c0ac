"""Slurm: make `dist.init_process_group("chainermn")` work under `srun` with no extra environment.

srun starts every task with SLURM_PROCID (rank), SLURM_STEP_NUM_TASKS (size), SLURM_LOCALID (rank on
the node), SLURM_NODEID (the node) and the step's node list, but none of env://'s variables. From them:

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node, as torchrun names it)
    MASTER_ADDR: the step's first node (task 0 runs there), 127.0.0.1 when the step has one node
    MASTER_PORT: 12000 + 16 * (SLURM_JOB_ID % 1250) + SLURM_STEP_ID % 16, under 32768 (below Linux's
                 ephemeral ports): the same on every task with no exchange, different for concurrent
                 steps of a job and for jobs near in number; set MASTER_PORT to choose another.

Variables already set win (MASTER_PORT, or all of them under a torchrun started by srun). Only the tasks
of a step count: the batch script itself (sbatch) also has SLURM_PROCID and SLURM_NTASKS, but it is one
process, not a job of SLURM_NTASKS ranks; it has no SLURM_STEP_NUM_TASKS.
"""

import os
import re


def launched(environ=os.environ) -> bool:
    """True in a task that srun started (not in an sbatch/salloc script outside srun)."""
    return "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ


def _split_top_level(text: str) -> list:
    """'a[1-2,5],b' -> ['a[1-2,5]', 'b']: commas inside brackets separate ranges, not hosts."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_ranges(ranges: str) -> list:
    """'01-03,7' -> ['01', '02', '03', '7'], keeping each range's zero padding."""
    values = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not high:
            values.append(low)
            continue
        width = len(low) if low.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_hostlist(hostlist: str) -> list:
    """Slurm's compact host list as host names, in order: 'node[01-03,07],gpu[1-2]x' -> node01, node02,
    node03, node07, gpu1x, gpu2x (what `scontrol show hostnames` prints, without needing scontrol)."""
    hosts = []
    for item in _split_top_level(hostlist.strip()):
        match = re.search(r"\[([^\]]*)\]", item)
        if match is None:
            hosts.append(item)
            continue
        head, tail = item[: match.start()], item[match.end() :]
        for value in _expand_ranges(match.group(1)):
            hosts.extend(expand_hostlist(head + value + tail))  # further brackets in the tail
    return hosts


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The task count of node `node` in SLURM_STEP_TASKS_PER_NODE's form: '2(x3),1' is 2, 2, 2, 1."""
    counts = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"chainermn: cannot read the tasks per node {tasks_per_node!r} from Slurm")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node]


def local_rank_and_size(environ=os.environ) -> tuple:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE or None) of this srun task, as strings."""
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node = int(environ.get("SLURM_NODEID", "0"))
    return environ.get("SLURM_LOCALID", "0"), str(tasks_on_node(per_node, node)) if per_node else None


def store_port(environ=os.environ) -> int:
    job, step = int(environ["SLURM_JOB_ID"]), int(environ.get("SLURM_STEP_ID", "0"))
    return 12000 + 16 * (job % 1250) + step % 16


def store_host(environ=os.environ) -> str:
    """Task 0's host: the step's first node, or loopback when the whole step is on one node."""
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    hosts = expand_hostlist(nodes)
    if environ.get("SLURM_STEP_NUM_NODES", str(len(hosts))) == "1":
        return "127.0.0.1"  # every task is on this host: loopback always works
    if not hosts:
        raise RuntimeError(
            "chainermn: srun set no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST; set MASTER_ADDR to the host of task 0"
        )
    return hosts[0]


def rendezvous_variables(environ=os.environ) -> dict:
    """env://'s variables for this srun task, from its SLURM_* variables (MASTER_* set already win)."""
    local_rank, local_size = local_rank_and_size(environ)
    variables = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": local_rank,
        "GROUP_RANK": environ.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or store_host(environ),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(store_port(environ)),
    }
    if local_size is not None:
        variables["LOCAL_WORLD_SIZE"] = local_size
    return variables


def prepare_environment() -> None:
    """Under srun, fill in env://'s variables that are not already set."""
    if not launched():
        return
    for name, value in rendezvous_variables().items():
        os.environ.setdefault(name, value)
