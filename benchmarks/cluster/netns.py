#!/usr/bin/env python
"""A small simulated cluster on one machine: K "nodes" as network namespaces on one bridge.

    cmnbr                  a namespace that holds only the bridge `br0` (so nothing is added to the
                           root namespace's links, routes or firewall)
    cmn0 .. cmn{K-1}       one namespace per node, each with `lo` up and one link `eth0`,
                           address 10.77.0.{I+1}/24, the node end of a veth pair whose other end,
                           `v{I}`, is a port of `br0` in cmnbr

With a rate, every node's link is shaped by a token bucket (tc tbf) in both directions: egress of
`eth0` in the node (traffic the node sends) and egress of `v{I}` in cmnbr (traffic the node
receives). Ranks of one node talk to each other over the node's own loopback, unshaped, like the
ranks of one real host; only traffic between nodes crosses the shaped links.

    netns.py up --nodes 2 --rate 1gbit     # (re)create; idempotent: tears down what exists first
    netns.py rate --rate 500mbit           # change the shaping of every node in place (none: remove)
    netns.py status                        # namespaces, addresses and qdiscs
    netns.py bw                            # one TCP stream node1 -> node0, to check the shaping
    netns.py link --node 1 --state down    # cut node 1 off the bridge (up: reconnect it)
    netns.py down                          # remove everything this script made; safe to repeat

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`). The same functions are used by run.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

PREFIX = "cmn"
BRIDGE_NS = PREFIX + "br"
BRIDGE = "br0"
IFNAME = "eth0"  # the node's link, as seen inside its namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.77.0"  # 10.77.0.0/24, node I is 10.77.0.{I+1}
MAX_NODES = 200
_NODE_NS = re.compile(rf"^{PREFIX}(\d+|br)$")

ETC_NETNS = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts
UNLIMITED = ("", "none", "0", "unlimited", "inf")


def node_ns(i: int) -> str:
    return f"{PREFIX}{i}"


def node_addr(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", "netns", "exec", ns, *cmd, check=check)


def existing() -> list[str]:
    """The namespaces this script owns that exist now."""
    out = _run("ip", "netns", "list").stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if _NODE_NS.match(n)]


def nodes() -> int:
    return sum(1 for n in existing() if n != BRIDGE_NS)


def parse_rate(rate: str | None) -> int | None:
    """A tc rate ('1gbit', '500mbit', '10gbit', '100mbps') in bits per second; None for no limit."""
    if rate is None or rate.strip().lower() in UNLIMITED:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?", rate.strip().lower())
    if not m:
        raise ValueError(f"cannot read rate {rate!r}: use e.g. 100mbit, 1gbit, 10gbit or none")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    if m.group(3) == "bps":  # tc's bps means bytes per second
        value *= 8
    if value <= 0:
        return None
    return int(value)


def rate_label(rate: str | None) -> str:
    bits = parse_rate(rate)
    if bits is None:
        return "none"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // int(scale)}{unit}"
    return f"{bits}bit"


def _shape(ns: str, dev: str, bits: int | None) -> None:
    if bits is None:
        _ns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        return
    # A token bucket as deep as 4 ms of traffic (at least 128 KiB, so one 64 KiB GSO packet fits
    # whole) and a queue of at most 50 ms: a few packets burst at line speed, anything longer is
    # held to the rate.
    burst = max(int(bits / 8 * 0.004), 128 * 1024)
    _ns(
        ns,
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{bits}bit",
        "burst",
        str(burst),
        "latency",
        "50ms",
    )


def set_rate(rate: str | None) -> None:
    """Shape every node's link (both directions) to `rate`; None/'none' removes the shaping."""
    bits = parse_rate(rate)
    k = nodes()
    if k == 0:
        raise RuntimeError("no cluster namespaces: run `netns.py up` first")
    for i in range(k):
        _shape(node_ns(i), IFNAME, bits)
        _shape(BRIDGE_NS, f"v{i}", bits)


def set_link(node: int, up: bool) -> None:
    """Take node `node`'s port on the bridge down (or back up): its link stays configured but nothing
    passes, as when a switch drops a node or a cable is pulled; connections resume when it is up
    again unless one side gave up meanwhile."""
    if not 0 <= node < nodes():
        raise ValueError(f"no node {node}: the cluster has {nodes()} nodes")
    _ns(BRIDGE_NS, "ip", "link", "set", f"v{node}", "up" if up else "down")


def down() -> None:
    """Delete every namespace this script made (their veths and the bridge go with them)."""
    for ns in existing():
        _run("ip", "netns", "del", ns, check=False)
    if os.path.isdir(ETC_NETNS):
        for name in os.listdir(ETC_NETNS):
            if _NODE_NS.match(name):
                shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
        try:
            os.rmdir(ETC_NETNS)  # only if nothing else lives there
        except OSError:
            pass


def up(k: int, rate: str | None = None) -> None:
    if not 1 <= k <= MAX_NODES:
        raise ValueError(f"--nodes must be 1..{MAX_NODES}, got {k}")
    down()
    try:
        _run("ip", "netns", "add", BRIDGE_NS)
        _ns(BRIDGE_NS, "ip", "link", "set", "lo", "up")
        _ns(BRIDGE_NS, "ip", "link", "add", BRIDGE, "type", "bridge")
        _ns(BRIDGE_NS, "ip", "link", "set", BRIDGE, "up")
        # Names for the node addresses, so reverse lookups (c10d logs the peer's name) answer at once.
        hosts = "127.0.0.1 localhost\n" + "".join(f"{node_addr(i)} node{i}\n" for i in range(k))
        for i in range(k):
            ns = node_ns(i)
            os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
            with open(os.path.join(ETC_NETNS, ns, "hosts"), "w") as f:
                f.write(hosts)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", f"v{i}", "netns", BRIDGE_NS)
            _ns(BRIDGE_NS, "ip", "link", "set", f"v{i}", "master", BRIDGE)
            _ns(BRIDGE_NS, "ip", "link", "set", f"v{i}", "up")
            _ns(ns, "ip", "link", "set", "lo", "up")
            _ns(ns, "ip", "addr", "add", f"{node_addr(i)}/24", "dev", IFNAME)
            _ns(ns, "ip", "link", "set", IFNAME, "up")
        set_rate(rate)
        check_connectivity(k)
    except BaseException:
        down()
        raise


_LISTEN = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); s.settimeout(10)
print("ready", flush=True)
for _ in range(int(sys.argv[3])):
    c, _ = s.accept(); c.sendall(b"ok"); c.close()
"""
_CONNECT = """
import socket, sys
for addr in sys.argv[2:]:
    c = socket.create_connection((addr, int(sys.argv[1])), timeout=5)
    assert c.recv(2) == b"ok", addr
"""


def check_connectivity(k: int, port: int = 29399) -> None:
    """Every node opens a TCP connection to every other one (there is no ping here)."""
    if k < 2:
        return
    listeners = []
    try:
        for j in range(k):
            p = subprocess.Popen(
                ["ip", "netns", "exec", node_ns(j), sys.executable, "-c", _LISTEN, node_addr(j), str(port), str(k - 1)],
                stdout=subprocess.PIPE,
                text=True,
            )
            listeners.append(p)
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"listener in {node_ns(j)} did not start")
        for i in range(k):
            others = [node_addr(j) for j in range(k) if j != i]
            _ns(node_ns(i), sys.executable, "-c", _CONNECT, str(port), *others)
        for p in listeners:
            if p.wait(timeout=10) != 0:
                raise RuntimeError("a connectivity listener failed")
    finally:
        for p in listeners:
            if p.poll() is None:
                p.kill()
                p.wait()


_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); s.settimeout(30)
print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); mv = memoryview(buf); got = 0; t0 = None
while True:
    n = c.recv_into(mv)
    if not n:
        break
    if t0 is None:
        t0 = time.perf_counter()
    got += n
print(got / (time.perf_counter() - t0), flush=True)
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
buf = bytes(1 << 20); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    c.sendall(buf)
c.close()
"""


def measure_bandwidth(src: int = 1, dst: int = 0, seconds: float = 2.0, port: int = 29398) -> float:
    """TCP throughput of one stream from node src to node dst, in bits per second."""
    sink = subprocess.Popen(
        ["ip", "netns", "exec", node_ns(dst), sys.executable, "-c", _SINK, node_addr(dst), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError("bandwidth sink did not start")
        _ns(node_ns(src), sys.executable, "-c", _SOURCE, node_addr(dst), str(port), str(seconds))
        return float(sink.stdout.readline()) * 8
    finally:
        if sink.poll() is None:
            sink.kill()
        sink.wait()


def status() -> str:
    lines = []
    for ns in sorted(existing()):
        addrs = _ns(ns, "ip", "-br", "addr", check=False).stdout.strip()
        qdiscs = _ns(ns, "tc", "qdisc", "show", check=False).stdout.strip()
        lines.append(f"[{ns}]\n{addrs}\n{qdiscs}")
    return "\n".join(lines) if lines else "no cluster namespaces"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="(re)create K node namespaces on a bridge")
    p_up.add_argument("--nodes", type=int, default=2)
    p_up.add_argument("--rate", default="none", help="tc rate per link and direction (1gbit, 500mbit, ...) or none")
    p_rate = sub.add_parser("rate", help="change the shaping of the existing nodes")
    p_rate.add_argument("--rate", required=True)
    sub.add_parser("down", help="remove the namespaces")
    sub.add_parser("status", help="show the namespaces, addresses and qdiscs")
    p_link = sub.add_parser("link", help="take a node's link down or bring it back up")
    p_link.add_argument("--node", type=int, required=True)
    p_link.add_argument("--state", choices=["up", "down"], required=True)
    p_bw = sub.add_parser("bw", help="measure one TCP stream from node 1 to node 0 (a check of the shaping)")
    p_bw.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.cmd == "up":
        up(args.nodes, args.rate)
        print(
            f"up: {args.nodes} nodes ({', '.join(f'{node_ns(i)}={node_addr(i)}' for i in range(args.nodes))}), "
            f"link {rate_label(args.rate)}"
        )
    elif args.cmd == "rate":
        set_rate(args.rate)
        print(f"rate: {rate_label(args.rate)} on {nodes()} nodes")
    elif args.cmd == "link":
        set_link(args.node, args.state == "up")
        print(f"node {args.node}: link {args.state}")
    elif args.cmd == "bw":
        print(f"node1 -> node0: {measure_bandwidth(1, 0, args.seconds) / 1e9:.3f} Gbit/s (one TCP stream)")
    elif args.cmd == "down":
        down()
        print("down")
    else:
        print(status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
