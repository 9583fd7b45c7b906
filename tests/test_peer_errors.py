"""A lost peer's error names its global rank and host, on every collective path (Note [Naming a peer] in
csrc/comm/peer_names.h): the flat ring's reduce-scatter and all-gather, the two-level (node-aware) all-gather,
the inter-node hop of node-aware and hybrid sharding inside a training step, stage 3's parameter gathers
inside a forward, and OneBitAdam's 1-bit exchange.

Every layout makes a peer's index in the group it was lost from differ from its global rank (4 ranks as 2
nodes x 2: the across-nodes group {0, 2} numbers global rank 2 as its rank 1), so an error that named only
the group rank fails here. A peer is lost in one of two ways: killed (SIGKILL: its sockets close, the
survivors hear at once) or hung (alive, never calls the collective: only the group's timeout, a few seconds
here, tells). A rank waiting on the lost peer names it; a rank whose own peer gave up because of the loss
names that peer (the failure travels along the ring), which is why each test says which survivors name which
rank.
"""
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import RankFailure, run_ranks
from models import VOCAB, StackNet, batch

TIMEOUT = 3  # the process group's timeout, seconds (that of every subgroup shardopt builds, too)
TRAINING_TIMEOUT = 5  # the same where 4 ranks build an optimizer and train first: margin on a loaded machine


def _host_of_the_ranks() -> str:
    """What every rank says its host is: the ranks' GLOO_SOCKET_IFNAME is lo unless this process has one
    (shardopt/cluster/ranks.py), so "hostname/127.0.0.1" here."""
    from shardopt.parallel.peers import this_host

    had = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        return this_host()
    finally:
        if had is None:
            del os.environ["GLOO_SOCKET_IFNAME"]


HOST = _host_of_the_ranks()


class _Lost(Exception):
    """Raised on the lost rank once it wakes (hung), to leave what it was in."""


def _lose(how: str, timeout_s: float = TIMEOUT) -> None:
    """This rank is the lost peer: killed, or alive past the survivors' timeout without calling anything."""
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(timeout_s + 1)  # past the survivors' timeout (waking earlier would close its sockets: the same errors)


def _together() -> None:
    """Every rank here once the groups are built and before a peer is lost: a rank that returns from gloo's
    connectFullMesh of a new group may leave its partner still inside it, and killing it then fails the
    partner in new_group ("Connection closed by peer"), not in the collective under test (CI, 2026-11-29).
    A barrier with its own, generous timeout: forked ranks of a loaded machine run seconds apart. (The world
    group's own connections: run_ranks waits for them, Note [Every rank connected before any leaves] in
    shardopt/cluster/ranks.py.)"""
    import datetime

    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)


def _hybrid_env() -> None:
    """4 ranks as 2 nodes x 2, as torchrun says it (node-aware by default; shard_group="node" builds the mesh,
    its groups with the world's timeout)."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"


def _errors(fn, world_size, *args, timeout_s=TIMEOUT):
    """Runs fn on `world_size` ranks, one of which is lost; every survivor that fails raises. Returns
    {rank: what it raised (its traceback)} for the ranks that failed, "died" for a killed one."""
    try:
        run_ranks(fn, world_size, *args, timeout=120, collective_timeout=timeout_s)
    except RankFailure as e:
        parts = re.split(r"\n--- rank (\d+) ---\n", str(e))
        return {int(r): ("died" if re.match(r"rank \d+ died with exit code", text) else text)
                for r, text in zip(parts[1::2], parts[2::2])}
    pytest.fail("no rank failed: the peer was not lost")


def _names(text: str, global_rank: int, group_rank: int, label: str) -> bool:
    return f"global rank {global_rank} (host {HOST}, rank {group_rank} of the {label} group)" in text


def _names_a_peer(text: str, me: int) -> bool:
    """Names some other rank by its global rank and host (a survivor that lost a peer which gave up)."""
    found = re.findall(r"(?:from|to) global rank (\d+) \(host " + re.escape(HOST), text)
    return bool(found) and all(int(g) != me for g in found)


# ------------------------------------------------------------------ the flat ring
def _ring(rank, world_size, op, how):
    """A ring over global ranks 1 and 3 (group ranks 0 and 1); rank 3 is lost."""
    from shardopt.parallel import comm, peers

    peers.learn_hosts(dist.group.WORLD)  # as the optimizer's construction does
    group = dist.new_group([1, 3])
    _together()
    if rank in (0, 2):
        return None
    if rank == 3:
        _lose(how)
        return None
    time.sleep(0.5)  # a killed peer is gone before the op starts; a hung one never joins
    if op == "reduce_scatter":
        comm.start_reduce_scatter(torch.ones(1 << 12), torch.empty(1 << 11), group=group).wait()
    else:
        comm.start_all_gather(torch.ones(1 << 11), torch.empty(1 << 12), group=group).wait()
    return None


@pytest.mark.parametrize("op,how", [("reduce_scatter", "killed"), ("all_gather", "hung")])
def test_flat_ring_names_the_lost_peer(op, how):
    errors = _errors(_ring, 4, op, how)
    assert sorted(errors) == ([1, 3] if how == "killed" else [1]), errors
    assert f"shardopt ring {op} on rank 0 of 2 in the process group (global rank 1)" in errors[1], errors[1]
    assert _names(errors[1], 3, 1, "process"), errors[1]


# ------------------------------------------------------------------ the two-level all-gather
def _two_level(rank, world_size, how):
    """2 nodes x 2 (node {0, 1} and {2, 3}; across {0, 2} and {1, 3}); rank 3 is lost."""
    from shardopt.parallel import comm, peers
    from shardopt.parallel.mesh import two_level_groups
    from shardopt.parallel.mesh_plan import MeshShape

    peers.learn_hosts(dist.group.WORLD)
    node, across = two_level_groups(MeshShape(2, 2), dist.group.WORLD)
    _together()
    if rank == 3:
        _lose(how)
    time.sleep(0.5)
    comm.start_two_level_all_gather(torch.ones(1000), torch.empty(4000), node, across).wait()
    return None


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_two_level_all_gather_names_the_lost_peer(how):
    errors = _errors(_two_level, 4, how)
    # Rank 1 gathers across the nodes with rank 3 (its rank 1 there); rank 2 gathers inside node 1 with it.
    assert _names(errors[1], 3, 1, "across-nodes"), errors[1]
    assert "shardopt ring all_gather on rank 0 of 2 in the across-nodes group (global rank 1)" in errors[1]
    assert _names(errors[2], 3, 1, "node"), errors[2]
    # Rank 0 waits inside node 0 for rank 1, which waits for rank 3.
    assert _names_a_peer(errors[0], 0), errors[0]


# ------------------------------------------------------------------ the inter-node hop, in training
def _hop(rank, world_size, layout, how):
    """Stage 2, 4 ranks as 2 nodes x 2: node-aware flat sharding (reduce-scatter in the node, then the hop
    across with the same local rank) or a (replicate, shard) mesh (reduce-scatter in the shard group, the hop
    in the replicate group). Rank 2 is lost before its second backward."""
    import shardopt

    torch.manual_seed(0)
    model = StackNet(depth=2)
    _hybrid_env()
    # One bucket: its reduce-scatter inside the node is done on every rank before any hop can fail, so rank 0
    # fails in its hop with rank 2, not in a later bucket's reduce-scatter with rank 1 (which gave up too).
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, stage=2,
                                    reduce_bucket_size=10**7, **({} if layout == "nodes" else {"shard_group": "node"}))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    assert (opt.sharding.nodes is not None) == (layout == "nodes") and len(opt.layout.buckets) == 1
    wrapper = shardopt.ShardedDDP(model, opt)
    for step in range(2):
        if step == 1 and rank == 2:
            _lose(how, TRAINING_TIMEOUT)
            return None
        x, y = batch(step, rank)
        loss = torch.nn.functional.cross_entropy(wrapper(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return None


@pytest.mark.parametrize("how", ["killed", "hung"])
@pytest.mark.parametrize("layout", ["nodes", "mesh"])
def test_inter_node_hop_names_the_lost_peer(layout, how):
    errors = _errors(_hop, 4, layout, how, timeout_s=TRAINING_TIMEOUT)
    across, inside = ("across-nodes", "node") if layout == "nodes" else ("replicate", "shard")
    # Rank 0's hop partner is rank 2 (its rank 1 there): the issue's message, with the global rank.
    assert "inter-node hop of bucket" in errors[0] and _names(errors[0], 2, 1, across), errors[0]
    assert "failed on rank 0 of 4 in the world group (global rank 0)" in errors[0] or layout == "mesh", errors[0]
    assert "The node may be down or its link cut" in errors[0], errors[0]
    # Rank 3 reduces inside node 1 with rank 2 (its rank 0 there).
    assert _names(errors[3], 2, 0, inside), errors[3]
    # Rank 1 hops with rank 3, which gave up.
    assert _names_a_peer(errors[1], 1), errors[1]


# ------------------------------------------------------------------ stage 3's parameter gathers
def _stage3(rank, world_size, how):
    """Stage 3, node-aware, 2 nodes x 2 (its gathers are two-level, on groups of their own); rank 3 is lost
    in the middle of its second forward, after its first block."""
    import shardopt

    torch.manual_seed(0)
    model = StackNet(depth=4)
    _hybrid_env()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, stage=3,
                                    reduce_bucket_size=1000)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    assert opt.sharding.nodes is not None
    wrapper = shardopt.ShardedDDP(model, opt)

    def lost(*_):
        _lose(how, TRAINING_TIMEOUT)
        raise _Lost()

    for step in range(2):
        if step == 1 and rank == 3:
            model.blocks[0].register_forward_hook(lost)
        x, y = batch(step, rank)
        try:
            loss = torch.nn.functional.cross_entropy(wrapper(x).reshape(-1, VOCAB), y.reshape(-1))
        except _Lost:
            return None  # (hung: woke after the others failed)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return None


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_stage3_gathers_name_the_lost_peer(how):
    errors = _errors(_stage3, 4, how, timeout_s=TRAINING_TIMEOUT)
    # Rank 1 gathers across the nodes with rank 3; rank 2 inside node 1 with it.
    assert "shardopt ring all_gather on rank 0 of 2 in the across-nodes group (global rank 1)" in errors[1], errors[1]
    assert _names(errors[1], 3, 1, "across-nodes"), errors[1]
    assert "shardopt ring all_gather on rank 0 of 2 in the node group (global rank 2)" in errors[2], errors[2]
    assert _names(errors[2], 3, 1, "node"), errors[2]
    assert _names_a_peer(errors[0], 0), errors[0]


# ------------------------------------------------------------------ the 1-bit exchange
def _onebit(rank, world_size, how):
    """OneBitAdam's exchange on a 2 x 2 mesh's replicate groups ({0, 2} and {1, 3}); rank 2 is lost, so rank
    0 is left alone in its exchange while ranks 1 and 3 finish theirs."""
    from shardopt import onebit
    from shardopt.parallel.mesh import resolve_groups

    _hybrid_env()
    groups = resolve_groups(shard_group="node")  # as ShardedOptimizer(..., shard_group="node") builds them
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    n = 2 * 4096
    chunk, worker, server = torch.randn(n), torch.zeros(n), torch.zeros(n // 2)
    _together()
    if rank == 2:
        _lose(how)
        return None
    time.sleep(0.5)
    onebit.allreduce_1bit(chunk, groups.replicate, groups.replica, worker, server)
    return None


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_onebit_exchange_names_the_lost_peer(how):
    errors = _errors(_onebit, 4, how)
    assert sorted(errors) == ([0, 2] if how == "killed" else [0]), errors
    assert "shardopt all_to_all on rank 0 of 2 in the replicate group (global rank 0)" in errors[0], errors[0]
    assert _names(errors[0], 2, 1, "replicate"), errors[0]


# ------------------------------------------------------------------ the names themselves
def _names_of_groups(rank, world_size):
    from shardopt._ext import _C
    from shardopt.parallel import peers
    from shardopt.parallel.mesh import copy_group, two_level_groups
    from shardopt.parallel.mesh_plan import MeshShape

    peers.learn_hosts(dist.group.WORLD)
    node, across = two_level_groups(MeshShape(2, 2), dist.group.WORLD)
    unnamed = dist.new_group([0, 1, 2, 3])
    other = dist.new_group([1, 3])
    return dict(node=[peers.peer_name(node, r) for r in range(2)], across=peers.peer_name(across, 1),
                copy=peers.peer_name(copy_group(across), 1), me=peers.self_name(across),
                world=peers.peer_name(dist.group.WORLD, 3), same_as_world=peers.peer_name(unnamed, 2),
                other=peers.peer_name(other, 1) if rank in (1, 3) else None,
                never=_C.peer_name(dist.new_group([0, 1, 2, 3]), 1))


def test_peer_names_say_global_rank_host_and_group_rank():
    import socket

    assert HOST == f"{socket.gethostname()}/127.0.0.1" or "GLOO_SOCKET_IFNAME" in os.environ, HOST
    got = run_ranks(_names_of_groups, 4)
    h = f"(host {HOST}, "
    assert got[2]["node"] == [f"global rank 2 {h}rank 0 of the node group)",
                              f"global rank 3 {h}rank 1 of the node group)"]
    assert got[0]["across"] == f"global rank 2 {h}rank 1 of the across-nodes group)"
    assert got[1]["across"] == f"global rank 3 {h}rank 1 of the across-nodes group)"
    assert got[1]["copy"] == got[1]["across"]  # a copy of a group (stage 3's) is named as the group
    assert got[3]["me"] == "rank 1 of 2 in the across-nodes group (global rank 3)"
    assert got[0]["world"] == f"global rank 3 {h}rank 3 of the world group)"
    assert got[0]["same_as_world"] == f"global rank 2 {h}rank 2 of the world group)"
    assert got[1]["other"] == f"global rank 3 {h}rank 1 of the process group)"
    assert got[0]["never"] == "rank 1 of its group (global rank not registered)"


def test_gloo_address_names_the_ranks_there(monkeypatch):
    """gloo's own collectives (a step's flags all-reduce) name no peer, only, when a connection drops, its address:
    comm.all_reduce's error adds the ranks whose host has it (pure: the host table set by hand)."""
    from shardopt.parallel import peers

    monkeypatch.setattr(peers, "_hosts", {0: "a/10.0.0.1", 1: "a/10.0.0.1", 2: "b/10.0.0.2", 3: "b/10.0.0.2", 4: "c"})
    cause = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:21140. This is typically ..."
    assert peers.ranks_at_address(cause) == \
        "gloo's peer address 10.0.0.2 is that of global rank(s) [2, 3] (host b/10.0.0.2)"
    assert peers.ranks_at_address("Read error [10.0.0.1]:1: Connection reset by peer") == \
        "gloo's peer address 10.0.0.1 is that of global rank(s) [0, 1] (host a/10.0.0.1)"
    assert peers.ranks_at_address("Timed out waiting 3000ms for recv operation to complete") is None
    assert peers.ranks_at_address("Connection closed by peer [10.9.9.9]:5") is None
