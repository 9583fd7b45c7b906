"""Hybrid sharding, the process-group part: a (replicate, shard) mesh as groups (Note [Hybrid sharding] in
mesh_plan.py): `shard` reduce-scatters and gathers a bucket, `replicate` carries the inter-node hop, and
`world` holds every rank (a step's small agreements, cross-rank checks, the initial broadcast).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch.distributed as dist

from shardopt.parallel import peers
from shardopt.parallel.consistency import check_same_across_ranks
from shardopt.parallel.mesh_plan import MeshShape, node_mesh

MESH_DIM_NAMES = ("replicate", "shard")
logger = logging.getLogger("shardopt")


@dataclasses.dataclass(frozen=True)
class ShardingGroups:
    """The groups one ShardedOptimizer communicates over."""

    shape: MeshShape
    shard: object  # the ranks that shard one copy of the model (a node)
    replicate: object | None  # the ranks holding the same chunks in the other replicas; None when R == 1
    world: object  # every rank of the mesh
    replica: int  # this rank's replica index (0..R-1)
    nodes: MeshShape | None = None  # node-aware flat sharding: (nodes) x (ranks per node); else None
    node: object | None = None  # with `nodes`: this rank's node (the in-node phase)
    across: object | None = None  # with `nodes`: this local rank on every node (the link phase)

    def signature(self) -> list[str]:
        return [f"mesh {self.shape} nodes {self.nodes}"]


def require_dist() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shardopt needs torch.distributed: call torch.distributed.init_process_group(...) "
                           "first (launch with torchrun; a single process can use world_size=1)")


def resolve_groups(process_group=None, mesh=None, shard_group=None, device_type: str = "cpu",
                   node_aware: bool | None = None, why_not: str | None = None) -> ShardingGroups:
    """The groups for ShardedOptimizer's process_group= / mesh= / shard_group= (at most one of them).

    node_aware (Note [Two-level collectives]): True uses them or refuses, None when the ranks span nodes and
    `why_not` is None, False never."""
    given = [n for n, v in (("process_group", process_group), ("mesh", mesh), ("shard_group", shard_group))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"pass at most one of process_group=, mesh= and shard_group= (got {' and '.join(given)}): "
                         "process_group shards flat over one group, mesh/shard_group shard inside a node and "
                         "replicate across nodes")
    require_dist()
    if node_aware and (mesh is not None or shard_group is not None):
        raise ValueError("node_aware=True is for flat sharding; mesh= / shard_group= shard hybrid, which already "
                         "crosses the link with each gradient once: drop one of them")
    if shard_group is not None and shard_group != "node":
        raise ValueError(f'shard_group must be "node" (shard over the ranks of a node, replicate across '
                         f'nodes), got {shard_group!r}; for any other shape pass mesh=init_device_mesh(...) '
                         f'with mesh_dim_names={MESH_DIM_NAMES}')
    group = process_group if process_group is not None else dist.group.WORLD
    if mesh is not None:
        sharding = _from_device_mesh(mesh)
    elif shard_group is not None:
        sharding = _node_groups(device_type)
    elif node_aware is False or (process_group is not None and node_aware is None):
        sharding = _flat(group)
    else:
        if process_group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("node_aware=True needs flat sharding over every rank (process_group=None or the "
                             "world group); for a subgroup build a mesh and pass mesh= instead")
        sharding = _node_aware(group, node_aware, why_not, device_type)
    return _named(sharding)


def _named(sharding: ShardingGroups) -> ShardingGroups:
    """Registers the groups and every rank's host for errors (Note [Naming a peer]); a collective on the world."""
    peers.ensure_named(sharding.world)
    if sharding.shape.hybrid:
        peers.name_group(sharding.shard, "shard")
        peers.name_group(sharding.replicate, "replicate")
    else:
        peers.ensure_named(sharding.shard)
    peers.learn_hosts(sharding.world)
    return sharding


def _flat(group) -> ShardingGroups:
    return ShardingGroups(shape=MeshShape(1, dist.get_world_size(group)), shard=group, replicate=None,
                          world=group, replica=0)


def _local_world_size() -> tuple[str | None, int | None]:
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    return raw, int(raw) if raw and raw.isdigit() else None


def _node_aware(group, node_aware: bool | None, why_not: str | None, device_type: str) -> ShardingGroups:
    """Flat sharding over `group` (the world), node-aware when asked or when the ranks span nodes."""
    raw, local = _local_world_size()
    world = dist.get_world_size(group)
    if why_not is None and device_type != "cpu":
        why_not = f"a model on {device_type} (the two-level collectives run on CPU tensors, gloo, in this release)"
    # Every rank must take the same branch: the groups are built collectively.
    check_same_across_ranks([f"node_aware={node_aware} LOCAL_WORLD_SIZE={raw} off={why_not}"],
                            "node-aware collectives (LOCAL_WORLD_SIZE and options)", group)
    if node_aware is None and (local is None or local >= world or world % local):
        return _flat(group)
    if node_aware and why_not is not None:
        raise NotImplementedError(f"node_aware=True is not built for {why_not}; pass node_aware=False (flat "
                                  f"collectives)")
    if node_aware and (local is None or local >= world):
        raise ValueError(f"node_aware=True needs the ranks to span nodes: LOCAL_WORLD_SIZE={raw} at world size "
                         f"{world} (torchrun sets it; set it to the ranks per node, or drop node_aware)")
    shape = node_mesh(world, local)
    if why_not is not None:
        if dist.get_rank() == 0:
            logger.warning("shardopt: ranks span %d nodes, but node-aware collectives are not built for %s: "
                           "flat collectives (each gradient crosses the link as with DDP)", shape.replicas, why_not)
        return _flat(group)
    node, across = two_level_groups(shape, group)
    return dataclasses.replace(_flat(group), nodes=shape, node=node, across=across)


def two_level_groups(shape: MeshShape, group) -> tuple:
    """A new (node, across) pair of groups over the world `group`: this rank's node, and its local rank on every
    node (a collective; stage 3 makes a pair of its own)."""
    # The world's timeout, not c10d's 30 minutes: a lost node fails the survivors within the user's timeout.
    timeout = group_timeout(group)
    node, _ = dist.new_subgroups_by_enumeration([shape.shard_ranks(i) for i in range(shape.replicas)],
                                                timeout=timeout)
    across, _ = dist.new_subgroups_by_enumeration([shape.replicate_ranks(j) for j in range(shape.shards)],
                                                  timeout=timeout)
    return peers.name_group(node, "node"), peers.name_group(across, "across-nodes")


def copy_group(group, backend=None):
    """A new group of `group`'s ranks with its timeout (only those ranks call it); `backend`: another than the
    default's (gloo for small host tensors beside an NCCL group).

    Note [Naming a copied group]
    A group made with use_local_synchronization=True is named by a hash counting the groups this rank is a
    member of, so after a user group that leaves some rank out the ranks would name a copy differently and
    its rendezvous would time out. A copy of the world takes torch's ordinary naming (a counter every rank
    advances at every new_group); a subgroup's copy keeps the local naming (its non-members never call this)."""
    ranks = dist.get_process_group_ranks(group)
    local = len(ranks) != dist.get_world_size()
    copy = dist.new_group(ranks, use_local_synchronization=local, timeout=group_timeout(group), backend=backend)
    return peers.name_group(copy, peers.label_of(group) or peers.default_label(group))


def group_timeout(group):
    """The timeout `group` was made with (None: c10d's default), read from its CPU backend."""
    import torch

    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _node_groups(device_type: str) -> ShardingGroups:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    raw, local = _local_world_size()
    # Agree on the shape first: ranks that disagree would build different subgroups and wait forever.
    check_same_across_ranks([f'shard_group="node" LOCAL_WORLD_SIZE={raw}'], "mesh (nodes x ranks per node)",
                            dist.group.WORLD)
    shape = node_mesh(world, local)
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and local_rank.isdigit() and int(local_rank) != dist.get_rank() % shape.shards:
        raise ValueError(f'shard_group="node": rank {dist.get_rank()} has LOCAL_RANK={local_rank}, but the ranks '
                         f'of a node must be numbered consecutively (rank % LOCAL_WORLD_SIZE == LOCAL_RANK, as '
                         f'torchrun numbers them); build the mesh yourself and pass mesh=')
    if not shape.hybrid:
        return _flat(dist.group.WORLD)
    mesh = init_device_mesh(device_type, (shape.replicas, shape.shards), mesh_dim_names=MESH_DIM_NAMES,
                            backend_override=_keep_world_timeout(device_type))
    return _from_device_mesh(mesh)


def _keep_world_timeout(device_type: str):
    """init_device_mesh's backend_override giving the mesh's gloo groups the world's timeout; None off the CPU."""
    timeout = group_timeout(dist.group.WORLD)
    if device_type != "cpu" or timeout is None:
        return None
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return {name: ("gloo", options) for name in MESH_DIM_NAMES}


def _from_device_mesh(mesh) -> ShardingGroups:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:  # as FSDP2: a 1-D mesh shards flat over it
        return _flat(mesh.get_group())
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or names != MESH_DIM_NAMES:
        raise ValueError(f"mesh must be 1-D (flat sharding) or 2-D with mesh_dim_names={MESH_DIM_NAMES} "
                         f"(replicas across nodes, shards inside one), got a {mesh.ndim}-D mesh named {names or None}; "
                         f"e.g. init_device_mesh('cpu', (nodes, ranks_per_node), mesh_dim_names={MESH_DIM_NAMES}), "
                         f"or a slice mesh['replicate', 'shard'] of a bigger one")
    replicas, shards = (int(s) for s in mesh.mesh.shape)
    shape = MeshShape(replicas, shards)
    ranks = mesh.mesh.flatten().tolist()
    me = dist.get_rank()
    replica = next(i for i, row in enumerate(mesh.mesh.tolist()) if me in row)
    if sorted(ranks) == list(range(dist.get_world_size())):
        world = dist.group.WORLD
    else:  # a slice of a bigger mesh: its ranks, flattened
        world = mesh._flatten().get_group()
    check_same_across_ranks([f"mesh {shape} ranks {ranks}"], "device mesh", world)
    if world is not dist.group.WORLD:
        peers.name_group(world, "mesh")
    return ShardingGroups(shape=shape, shard=mesh.get_group("shard"),
                          replicate=mesh.get_group("replicate") if shape.hybrid else None, world=world,
                          replica=replica)
