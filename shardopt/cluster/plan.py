r"""Pure planning for the emulated cluster (shardopt/cluster/emulated.py): names, addresses, ip/tc and torchrun
command lines, as data (argv lists) that can be read and tested as tables; nothing here runs a command.

Note [Emulated cluster topology]
--------------------------------
    namespace <run>-sw                     a "switch": one bridge, no address, no other link
        br0 --- n0 --- veth --- so0   in namespace <run>-n0   198.18.0.1/24   (node 0)
            \-- n1 --- veth --- so0   in namespace <run>-n1   198.18.0.2/24   (node 1)
             \- ...
A node's only links are `lo` and `so0`, a veth to a port of the switch's bridge, both ends created inside
their namespaces (`ip link add ... netns`): nothing is added to the machine's own namespace, and no packet
can leave the machine. Addresses are in 198.18.0.0/15 (RFC 2544's benchmarking range). A token bucket
(`tc ... tbf`) on `so0` and on the switch port shapes each node's link both ways; ranks of one node talk
through its `lo`, unshaped. No `netem`, so no added delay: the link is slow, not far. Teardown deletes
exactly the plan's namespaces, never ones found by a pattern.

Note [A node shares nothing but its link]
-----------------------------------------
Network namespaces alone would leave the nodes one host: one hostname, one /dev/shm, so whatever finds its
peers through shared memory (stage 3's agreements, the shared-memory gathers: parallel/shared_memory.py)
would reach the other "nodes" without a byte on the shaped link. So each node also has a holder process
(`node_holder_command`) that, inside the node's network namespace, unshares a UTS namespace (hostname: the
node's namespace name) and a mount namespace with a tmpfs of its own on /dev/shm, then sleeps. Every
process of the node joins all three of the holder's namespaces (`enter_command`, nsenter), so the ranks of
one node share a host and the nodes share nothing but the link (and the machine's files: a job's
checkpoints, as on a shared file system). The tmpfs lives as long as the holder: a lost node's processes
die (`kill_node`), its /dev/shm stays, as on a machine whose processes crashed; the cluster's teardown and a
sweep kill the holders with the rest of the namespace's processes.

Note [Sweeping namespaces of dead runs]
---------------------------------------
A SIGKILL of a cluster's owner leaves its namespaces behind. `python -m shardopt.cluster --sweep` removes a
namespace only when its name is exactly `<prefix>-<pid>-<6 hex>-<sw | n<i>>` (what new_run_id and
plan_cluster make) and process <pid> is gone (or a zombie), so it never breaks a running cluster nor
touches anyone else's. Pids are this machine's; a reused pid keeps a stale cluster, erring on the safe side.
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
SHM = "/dev/shm"             # each node's own tmpfs (Note [A node shares nothing but its link])
READY = "ready"              # what a node's holder prints once its namespaces are set up

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class NodePlan:
    index: int
    netns: str
    addr: str
    port: str
    """The switch-side end of this node's veth (in the switch namespace)."""
    hostname: str
    """The node's own hostname (Note [A node shares nothing but its link])."""


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
    """'1gbit', '100mbit', '500k', 10**9 -> bits per second (k/m/g powers of 1000, as tc; tc's 'bps' is
    bytes, so only 'bit' or nothing is accepted); None or 0 -> None (unshaped)."""
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
    """Token bucket size in bytes: 4 ms at the rate (timer ticks of 1-4 ms must not cap it), at least 64 KiB
    (a veth hands tbf GSO segments of up to 64 KiB, and a smaller bucket would drop them)."""
    return max(64 * 1024, rate_bit // 8 * 4 // 1000)


def plan_cluster(nodes: int, rate=None, *, run_id: str) -> ClusterPlan:
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes must be 1..{MAX_NODES}, got {nodes}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}", run_id):
        raise ValueError(f"run_id {run_id!r}: letters, digits, '_', '.', '-' only (it names namespaces)")
    node_plans = tuple(NodePlan(i, f"{run_id}-n{i}", f"{SUBNET}.{i + 1}", f"n{i}", f"{run_id}-n{i}")
                       for i in range(nodes))
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


def node_holder_command(plan: ClusterPlan, node: int) -> list[str]:
    """The holder of node `node`'s hostname and /dev/shm (Note [A node shares nothing but its link]): it prints
    "ready" once both are its own, then sleeps until killed."""
    n = plan.nodes[node]
    script = (f"mount -t tmpfs -o mode=1777 {plan.run_id}-shm {SHM} && echo \"$1\" > /proc/sys/kernel/hostname "
              f"&& echo {READY} && exec sleep infinity")
    return ["ip", "netns", "exec", n.netns, "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", script, "sh", n.hostname]


def enter_command(holder_pid: int, argv, cwd: str) -> list[str]:
    """argv run inside a node: in its holder's network, UTS and mount namespaces, from directory `cwd` (entering a
    mount namespace starts at its root)."""
    return ["nsenter", "--target", str(holder_pid), "--net", "--uts", "--mount", f"--wd={cwd}", "--", *argv]


def link_command(plan: ClusterPlan, node: int, up: bool) -> list[str]:
    """Takes node `node`'s link down (or up again) at the switch, as a pulled cable would."""
    return ["ip", "-n", plan.switch, "link", "set", plan.nodes[node].port, "up" if up else "down"]


def torchrun_command(plan: ClusterPlan, node: int, nproc: int, script: str, args=(), *, nnodes,
                     max_restarts: int = 0, rdzv_id: str | None = None, rdzv_conf: dict | None = None,
                     port: int = RDZV_PORT, python: str = sys.executable) -> list[str]:
    """The torchrun command line of one node; `nnodes` is torchrun's (2, or "1:2" for elastic).

    Note [torchrun inside a namespace]
    ----------------------------------
    A node's own hostname resolves to no address c10d's rendezvous can reach, so the host node is told
    (`is_host=1`, the others 0) and every node advertises its address with --local-addr. Gloo is bound
    to the node's link by GLOO_SOCKET_IFNAME (node_env).
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
