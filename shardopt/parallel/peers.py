"""Who a peer is, for error messages: the registry of Note [Naming a peer] (csrc/comm/peer_names.h), e.g.

    global rank 2 (host node-b/10.0.0.7, rank 1 of the across-nodes group)

The C++ collectives read it when they fail; Python fills it: `name_group` for the groups shardopt builds,
`ensure_named` for a group it is given, `learn_hosts` once per optimizer.
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

from shardopt._ext import _C

GENERIC = "process"  # a group nobody named: "rank 1 of the process group"

_hosts: dict[int, str] = {}  # global rank -> host, as learn_hosts registered them in C++ too
_processes: dict[int, tuple] = {}  # global rank -> (hostname, pid), to tell a peer whose process exited


def this_host() -> str:
    """This rank's host as gloo reaches it: "hostname/address" of GLOO_SOCKET_IFNAME's first entry, or hostname."""
    name = socket.gethostname()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    addr = _interface_address(ifname) if ifname else None
    return f"{name}/{addr}" if addr else name


def _interface_address(ifname: str) -> str | None:
    """The IPv4 address of network interface `ifname` (Linux), or None."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (ImportError, OSError, ValueError):
        return None


def name_group(group, label: str):
    """Registers `group`'s members under `label` ("node": "rank 1 of the node group"); local; returns `group`."""
    if group is None or not _member(group):
        return group
    _C.set_group_members(group, label, dist.get_process_group_ranks(group))
    return group


def ensure_named(group) -> None:
    """Registers a caller's group unless registered: "world", its `group_desc`, or GENERIC."""
    if group is None or _C.has_group_members(group):
        return
    name_group(group, default_label(group))


def default_label(group) -> str:
    if group is dist.group.WORLD or (dist.is_initialized() and _same_as_world(group)):
        return "world"
    desc = getattr(group, "group_desc", None)
    if isinstance(desc, str) and desc and desc.lower() not in ("undefined", "default_pg"):
        return desc
    return GENERIC


def label_of(group) -> str:
    """The label `group` is registered with ("" for none)."""
    return _C.group_label(group) if group is not None else ""


def learn_hosts(group) -> None:
    """Every member of `group` learns every member's host (a collective: one small all-gather)."""
    if group is None or not _member(group):
        return
    mine = (this_host(), socket.gethostname(), os.getpid())
    everyone: list = [mine]
    if dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    _C.set_rank_hosts(ranks, [host or "" for host, _, _ in everyone])
    _hosts.update((g, host) for g, (host, _, _) in zip(ranks, everyone) if host)
    _processes.update((g, (name, pid)) for g, (_, name, pid) in zip(ranks, everyone))


def processes(group) -> list | None:
    """Every rank of `group`'s (hostname, pid), in the group's order, as learn_hosts heard them (None: not heard)."""
    found = [_processes.get(g) for g in dist.get_process_group_ranks(group)]
    return None if None in found else found


def ranks_at_address(text: str) -> str | None:
    """For a gloo error naming only an address ("Connection closed by peer [10.0.0.7]:4242"), which other ranks
    have that address: "gloo's peer address 10.0.0.7 is that of global rank(s) [2, 3] (host ...)", or None."""
    import re

    match = re.search(r"\[([0-9A-Fa-f:.]+)\]:\d+", text)
    if match is None:
        return None
    addr = match.group(1)
    me = dist.get_rank() if dist.is_initialized() else -1
    ranks = sorted(g for g, h in _hosts.items() if h.rsplit("/", 1)[-1] == addr and g != me)
    if not ranks:
        return None
    hosts = sorted({_hosts[g] for g in ranks})
    return f"gloo's peer address {addr} is that of global rank(s) {ranks} (host {', '.join(hosts)})"


def peer_name(group, rank: int) -> str:
    """How errors name rank `rank` of `group`: "global rank G (host H, rank r of the L group)"."""
    ensure_named(group)
    return _C.peer_name(group, rank)


def self_name(group) -> str:
    """How errors name this rank in `group`: "rank r of W in the L group (global rank G)"."""
    ensure_named(group)
    return _C.self_name(group)


def _member(group) -> bool:
    try:
        return dist.get_rank(group) >= 0
    except (RuntimeError, ValueError):
        return False


def _same_as_world(group) -> bool:
    try:
        return dist.get_process_group_ranks(group) == list(range(dist.get_world_size()))
    except (RuntimeError, ValueError):
        return False
