r"""Pure planning for the emulated cluster (shardopt/cluster/emulated.py): names, addresses, ip/tc and torchrun command lines.

Nothing here runs a command or touches the system; every function returns
data (argv lists), so the plan can be read and tested as tables.

Note [Emulated cluster topology]
--------------------------------
    namespace <run>-sw                     a "switch": one bridge, no address, no other link
        br0 --- n0 --- veth --- so0   in namespace <run>-n0   198.18.0.1/24   (node 0)
            \-- n1 --- veth --- so0   in namespace <run>-n1   198.18.0.2/24   (node 1)
             \- ...
Every node is a network namespace whose only links are `lo` and `so0`, one end
of a veth pair whose other end is a port of the switch's bridge. Both ends
are created directly inside their namespaces (`ip link add ... netns`), so
nothing is ever added to the machine's own namespace, and since the switch
has no link to the outside, no packet can leave the machine whatever a
process does (there is also no default route and no NAT). Addresses come from
198.18.0.0/15, the range reserved for benchmarking (RFC 2544); two clusters
may use the same addresses because their namespaces are separate.

The node's link is shaped in both directions by a token bucket (`tc qdisc
... tbf`): on `so0` for what the node sends and on the switch port for what
it receives, so each node has a full-duplex link of the given rate, as a NIC
to a switch would. Traffic between ranks of one node goes to a local address
and so through the node's `lo`: unshaped, as inside a real machine. This
kernel has no `netem`, so there is no added delay: the link is slow, not far.

Names: every namespace is `<prefix>-<pid>-<random>-<role>`, unique per run;
teardown deletes exactly the namespaces the plan names (deleting a namespace
deletes its veth ends and bridge with it), never one found by a pattern.

Note [Sweeping namespaces of dead runs]
---------------------------------------
A SIGKILL of the process that owns a cluster leaves its namespaces behind
(nothing can run in a killed process). `python -m shardopt.cluster --sweep`
removes them, and only them: a name is a candidate when it is exactly
`<prefix>-<pid>-<6 hex>-<sw | n<i>>` (what new_run_id and plan_cluster make;
prefix "shardopt" unless told), and it is removed when process <pid> no longer
exists (or is a zombie). Any other name, and every name whose owner is alive,
is left alone, so a sweep never breaks a running cluster nor touches anyone
else's namespaces. Pids are this machine's: sweep where the clusters were
made. A pid reused by an unrelated process keeps a stale cluster until that
process exits, which errs on the safe side.
"""
from __future__ import annotations

import dataclasses
import re
import sys

SUBNET = "198.18.0"          # /24 inside 198.18.0.0/15 (benchmarking range); node i is .(i+1)
PREFIX_LEN = 24
NODE_IF = "so0"              # the node's end of its link, in every node namespace
BRIDGE = "br0"               # in the switch namespace
RDZV_PORT = 29400            # free by construction: each node namespace has its own ports
MAX_NODES = 200

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class NodePlan:
    index: int
    netns: str
    addr: str
    port: str
    """The switch-side end of this node's veth (in the switch namespace)."""


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    run_id: str
    switch: str
    nodes: tuple[NodePlan, ...]
    rate_bit: int | None
    """Bits per second of every node's link in each direction; None: unshaped."""

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace the cluster creates, switch first (created first, deleted last)."""
        return (self.switch,) + tuple(n.netns for n in self.nodes)

    @property
    def host(self) -> NodePlan:
        """The node that hosts torchrun's rendezvous store (node 0)."""
        return self.nodes[0]


def parse_rate(rate) -> int | None:
    """'1gbit', '100mbit', '500k', 10**9 -> bits per second; None or 0 -> None (unshaped).

    As tc reads them: k/m/g are powers of 1000 and a bare number is bits
    (tc's own 'bps' means bytes per second; we accept only 'bit' or nothing).
    """
    if rate is None or rate == 0:
        return None
    if isinstance(rate, (int, float)):
        if rate < 0:
            raise ValueError(f"rate must be positive, got {rate}")
        return int(rate)
    m = _RATE.match(str(rate))
    if not m or (m.group(3) or "bit").lower() != "bit":
        raise ValueError(f"rate {rate!r}: expected e.g. '1gbit', '100mbit', '500kbit' or bits per second")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return int(value)


def tbf_burst(rate_bit: int) -> int:
    """Token bucket size in bytes: 4 ms at the rate, at least 64 KiB.

    A veth hands tbf segments of up to 64 KiB (GSO), and a bucket smaller than
    one packet would drop it; above that, 4 ms of line rate keeps the timer
    granularity (1-4 ms ticks) from capping the rate, while bursts stay short
    next to a collective of megabytes.
    """
    return max(64 * 1024, rate_bit // 8 * 4 // 1000)


def plan_cluster(nodes: int, rate=None, *, run_id: str) -> ClusterPlan:
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes must be 1..{MAX_NODES}, got {nodes}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}", run_id):
        raise ValueError(f"run_id {run_id!r}: letters, digits, '_', '.', '-' only (it names namespaces)")
    node_plans = tuple(NodePlan(i, f"{run_id}-n{i}", f"{SUBNET}.{i + 1}", f"n{i}") for i in range(nodes))
    return ClusterPlan(run_id=run_id, switch=f"{run_id}-sw", nodes=node_plans, rate_bit=parse_rate(rate))


def new_run_id(prefix: str, pid: int, token: str) -> str:
    """`<prefix>-<pid>-<token>`: the pid tells whose namespaces they are, the random token makes them unique."""
    return f"{prefix}-{pid}-{token}"


def namespace_owner(name: str, prefix: str = "shardopt") -> int | None:
    """The owner's pid in a namespace name this module makes with `prefix`, or None for any other name."""
    m = re.fullmatch(re.escape(prefix) + r"-(\d+)-[0-9a-f]{6}-(?:sw|n\d+)", name)
    return int(m.group(1)) if m else None


def stale_namespaces(names, alive, prefix: str = "shardopt") -> list[str]:
    """The names a sweep removes (Note [Sweeping namespaces of dead runs]): ours whose owner is dead,
    as `alive(pid) -> bool` says. Sorted, each run's nodes before its switch (the teardown order)."""
    stale = [n for n in names if (pid := namespace_owner(n, prefix)) is not None and not alive(pid)]
    return sorted(stale, key=lambda n: (n.rsplit("-", 1)[0], n.endswith("-sw"), n))


def setup_commands(plan: ClusterPlan) -> list[list[str]]:
    """The `ip`/`tc` commands that build the cluster, in order (Note [Emulated cluster topology])."""
    sw = plan.switch
    cmds = [["ip", "netns", "add", ns] for ns in plan.namespaces]
    cmds += [["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"],
             ["ip", "-n", sw, "link", "set", BRIDGE, "up"]]
    for n in plan.nodes:
        cmds += [["ip", "link", "add", NODE_IF, "netns", n.netns, "type", "veth", "peer", "name", n.port,
                  "netns", sw],
                 ["ip", "-n", sw, "link", "set", n.port, "master", BRIDGE],
                 ["ip", "-n", sw, "link", "set", n.port, "up"],
                 ["ip", "-n", n.netns, "addr", "add", f"{n.addr}/{PREFIX_LEN}", "dev", NODE_IF],
                 ["ip", "-n", n.netns, "link", "set", "lo", "up"],
                 ["ip", "-n", n.netns, "link", "set", NODE_IF, "up"]]
        cmds += shaping_commands(plan, n)
    return cmds


def shaping_commands(plan: ClusterPlan, node: NodePlan) -> list[list[str]]:
    """tbf on both ends of the node's veth: what it sends (so0) and what it receives (switch port)."""
    if plan.rate_bit is None:
        return []
    tbf = ["tbf", "rate", f"{plan.rate_bit}bit", "burst", str(tbf_burst(plan.rate_bit)), "latency", "100ms"]
    return [["ip", "netns", "exec", node.netns, "tc", "qdisc", "add", "dev", NODE_IF, "root"] + tbf,
            ["ip", "netns", "exec", plan.switch, "tc", "qdisc", "add", "dev", node.port, "root"] + tbf]


def teardown_commands(plan: ClusterPlan) -> list[list[str]]:
    """Deletes exactly the plan's namespaces (and with them their links), nodes first."""
    return [["ip", "netns", "delete", ns] for ns in reversed(plan.namespaces)]


def link_command(plan: ClusterPlan, node: int, up: bool) -> list[str]:
    """Takes node `node`'s link down (or up again) at the switch, as a pulled cable would."""
    return ["ip", "-n", plan.switch, "link", "set", plan.nodes[node].port, "up" if up else "down"]


def torchrun_command(plan: ClusterPlan, node: int, nproc: int, script: str, args=(), *, nnodes,
                     max_restarts: int = 0, rdzv_id: str | None = None, rdzv_conf: dict | None = None,
                     port: int = RDZV_PORT, python: str = sys.executable) -> list[str]:
    """The torchrun command line of one node, as a user would type it on that machine.

    `nnodes`: torchrun's --nnodes (2, or "1:2" for elastic): how many of the plan's nodes join.

    Note [torchrun inside a namespace]
    ----------------------------------
    c10d's rendezvous decides whether it hosts the store by comparing the
    endpoint with the machine's hostname and addresses; in a namespace the
    hostname resolves to an address it cannot reach, so the host node is told
    (`is_host=1`, the others `is_host=0`), and every node advertises its own
    address with --local-addr (otherwise it advertises the hostname, which
    the other nodes cannot resolve to it). Gloo is bound to the node's link by
    GLOO_SOCKET_IFNAME (cluster.node_env).
    """
    if not 0 <= node < len(plan.nodes):
        raise ValueError(f"node {node} not in a {len(plan.nodes)}-node cluster")
    conf = {"is_host": 1 if node == plan.host.index else 0}
    conf.update(rdzv_conf or {})
    return [python, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{plan.host.addr}:{port}",
            "--rdzv-id", rdzv_id or plan.run_id,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
            "--local-addr", plan.nodes[node].addr,
            "--max-restarts", str(max_restarts),
            script, *map(str, args)]


def node_env(base: dict, *, threads: int = 1) -> dict:
    """The environment of a node's torchrun: gloo on the node's link, `threads` torch threads per rank."""
    env = dict(base)
    env.update(GLOO_SOCKET_IFNAME=NODE_IF, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return env
