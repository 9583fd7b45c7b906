"""Hybrid sharding, the process-group part: a (replicate, shard) mesh as a pair of groups.

What the groups are for is in Note [Hybrid sharding] (mesh_plan.py). The
optimizer asks only three questions of a `ShardingGroups`: which group shards
a bucket (reduce-scatter, all-gather: `shard`), which group carries the
inter-node hop (`replicate`, None without one), and which group holds every
rank of the run (`world`: the small agreements of a step, the cross-rank
checks, the initial broadcast).
"""
from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from shardopt.parallel.consistency import check_same_across_ranks
from shardopt.parallel.mesh_plan import MeshShape, node_mesh

MESH_DIM_NAMES = ("replicate", "shard")


@dataclasses.dataclass(frozen=True)
class ShardingGroups:
    """The groups one ShardedOptimizer communicates over."""

    shape: MeshShape
    shard: object
    """ProcessGroup of the ranks that shard one copy of the model (a node)."""
    replicate: object | None
    """ProcessGroup of the ranks holding the same chunks in other replicas; None when R == 1."""
    world: object
    """ProcessGroup of every rank of the mesh."""
    replica: int
    """This rank's replica index (0..R-1)."""

    def signature(self) -> list[str]:
        return [f"mesh {self.shape}"]


def require_dist() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shardopt needs torch.distributed: call torch.distributed.init_process_group(...) "
                           "first (launch with torchrun; a single process can use world_size=1)")


def resolve_groups(process_group=None, mesh=None, shard_group=None, device_type: str = "cpu") -> ShardingGroups:
    """The groups for ShardedOptimizer's process_group= / mesh= / shard_group= (at most one of them)."""
    given = [n for n, v in (("process_group", process_group), ("mesh", mesh), ("shard_group", shard_group))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"pass at most one of process_group=, mesh= and shard_group= (got {' and '.join(given)}): "
                         "process_group shards flat over one group, mesh/shard_group shard inside a node and "
                         "replicate across nodes")
    require_dist()
    if mesh is not None:
        return _from_device_mesh(mesh)
    if shard_group is not None:
        if shard_group != "node":
            raise ValueError(f'shard_group must be "node" (shard over the ranks of a node, replicate across '
                             f'nodes), got {shard_group!r}; for any other shape pass mesh=init_device_mesh(...) '
                             f'with mesh_dim_names={MESH_DIM_NAMES}')
        return _node_groups(device_type)
    group = process_group if process_group is not None else dist.group.WORLD
    return _flat(group)


def _flat(group) -> ShardingGroups:
    return ShardingGroups(shape=MeshShape(1, dist.get_world_size(group)), shard=group, replicate=None,
                          world=group, replica=0)


def _node_groups(device_type: str) -> ShardingGroups:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    local = int(raw) if raw and raw.isdigit() else None
    # Agree on the shape before building groups: ranks that disagree would
    # otherwise create different subgroups and wait for each other forever.
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
    mesh = init_device_mesh(device_type, (shape.replicas, shape.shards), mesh_dim_names=MESH_DIM_NAMES)
    return _from_device_mesh(mesh)


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
    return ShardingGroups(shape=shape, shard=mesh.get_group("shard"),
                          replicate=mesh.get_group("replicate") if shape.hybrid else None, world=world,
                          replica=replica)
