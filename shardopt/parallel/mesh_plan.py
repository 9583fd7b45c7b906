"""Hybrid sharding, the pure part: who shards with whom, who replicates with whom, and what crosses the link.

No process group here (mesh.py builds them); tests need only numbers.

Note [Hybrid sharding]
----------------------
W = R * K ranks form a (replicate R) x (shard K) mesh, rank = replica * K + shard (a replica is a node, as
torchrun numbers ranks). Each replica holds the model sharded K ways, as flat ZeRO over K. Per step, with S
bytes of gradients:

  backward: each bucket is reduce-scattered inside the replica, then this rank's chunk is all-reduced with
            the ranks holding the same chunk in the other replicas (the *inter-node hop*). A node's K ranks
            hop at once, 1/K of the bucket each: 2 (R-1)/R * S per node, where a flat ring sends
            2 (W-1)/W * S and crosses the link again with the parameter all-gather;
  step:     each rank steps its chunk;
  gather:   inside the replica only: no parameter byte crosses the link.

Gradients are pre-divided by W, so the two sums give the average. State costs 1/K per rank, not 1/W: memory
traded for link bytes. The hop may be compressed (Note [Compressed inter-node hop] in csrc/comm/replica_hop.h).

Note [Two-level collectives]
----------------------------
Flat sharding over W = R * K ranks on R nodes keeps state at 1/W, but its ring reduce-scatter and all-gather
cross a node's link with 2 (W-1)/W * S per step, as DDP. Node-aware collectives send the hybrid's bytes:

  reduce:  a reduce-scatter inside the node leaves local rank j the node's sum of node chunk j (1/K of the
           bucket); phase 1 of the hop among the R ranks of local rank j leaves node i's rank part i of it
           (1/W, its chunk: Note [Node-aware chunk order] in layout.py) summed over every rank. A node's
           K ranks send (R-1)/R * S together.
  step:    on 1/W.
  gather:  the mirror: the R ranks of local rank j all-gather their parts into node chunk j ((R-1)/R * S
           per node, in the parameters' dtype), then each node all-gathers its K node chunks inside.

Per node 2 (R-1)/R * S with flat's memory; the gradient phase may be compressed (inter_node_dtype), the
parameter phase only when asked (Note [Parameters across nodes in bf16]). Stage 3 gathers each bucket
before forward and again before backward (Note [Stage-3 schedule] in zero3/schedule.py), both two-level on
groups of its own (csrc/comm/two_level.h): a node sends 3 (R-1)/R * S per step where a flat ring sends
3 (W-1)/W * S (less the buckets backward starts with, gathered once: Note [The seam between forward and
backward] in zero3/rounds.py).

Every sum is the flat ring's W fp32 addends grouped node first: flat's result up to summation order.

Note [Parameters across nodes in bf16]
--------------------------------------
With a bf16 gradient phase ((R-1)/R * S/2 per node) the fp32 parameter phase ((R-1)/R * S) is two thirds of
the link's bytes; inter_node_param_dtype=torch.bfloat16 halves it. Rounding only what is sent would leave the
owner's values unlike the others', so every rank's model holds the parameters rounded to bf16 and the
optimizer keeps fp32 masters of its 1/W (+4 bytes per parameter / W; Note [Master weights] in master_step.py),
as bf16 mixed precision does (ZeRO++ does it in int8); activations, gradients and reductions stay fp32.
Node-aware flat sharding only (hybrid sends no parameter across nodes); stage 3: the next Note.

Note [Stage 3's parameters across nodes, rounded]
-------------------------------------------------
Stage 3 gathers each bucket twice per step, so its parameter phase is two thirds of an exact step's link
bytes, and all of them but the gradient phase's. Its shard already is an fp32 master (the model's values
exist only while a pass has them gathered), so inter_node_param_dtype rounds in the gather alone: in the
two-level all-gather (csrc/comm/two_level.h) each rank sends its chunk in the narrow format and every rank,
the owner too, decodes every chunk from the same message into the bucket. So every rank's model holds the
same rounded values, no second master is kept, the shard is never rounded, checkpoints hold it exact, and
a step after a load equals the uninterrupted run's (the next gather rounds the same shard the same way).
  torch.bfloat16   each value rounded to bf16: 2 bytes an element.
  "int8"           per chunk, blocks of 256 values: scale = max|x| / 127 (fp32), round-half-even(x / scale)
                   in [-127, 127]: the hop's codec without its error feedback (Note [Fused int8 codec] in
                   csrc/comm/int8_codec.h), 1 + 4/256 bytes an element; a value moves by at most half a
                   step, scale / 2, and a block of zeros stays zeros.
Only a pass's gathers round (forward, backward, and what a peer's pass asks for). Whole weights
(full_params, state_dict, save_weights, detach) and the persistent buckets are gathered exact: they live
outside passes, and full_params(writeback=True) writes this rank's part back into the shard, which a
rounded copy would overwrite. Per node per step 2 (R-1)/R of the parameters in the phase's format plus the
gradient phase's (R-1)/R (less the seam's buckets, gathered once: Note [The seam between forward and
backward] in zero3/rounds.py); with both in int8 about a quarter of the exact 3 (R-1)/R * S.
"""
from __future__ import annotations

import dataclasses

import torch

HOP_DTYPES = ("bfloat16", "int8", "onebit")  # compressed hop formats; None: the reduction dtype, exact
INT8_BLOCK = 256  # elements per fp32 scale of the int8 hop: kInt8Block in csrc/comm/int8_kernel.h
ONEBIT_BLOCK = 1024  # onebit.ONEBIT_BLOCK, repeated: this module imports nothing of shardopt


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A (replicate, shard) mesh over ranks 0..W-1, rank = replica * shards + shard."""

    replicas: int  # R: copies of the sharded model (nodes, with shard_group="node")
    shards: int  # K: ranks one copy is sharded over (a node's)

    def __post_init__(self):
        for field in ("replicas", "shards"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh {field} must be a whole number >= 1, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.replicas * self.shards

    @property
    def hybrid(self) -> bool:
        """Gradients take an inter-node hop (more than one replica)."""
        return self.replicas > 1

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, shard) of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a {self} mesh of {self.world_size} ranks")
        return divmod(rank, self.shards)

    def shard_ranks(self, replica: int) -> list[int]:
        """The ranks that shard one copy of the model together (one node)."""
        return [replica * self.shards + s for s in range(self.shards)]

    def replicate_ranks(self, shard: int) -> list[int]:
        """The ranks that hold the same chunks (one per replica): the inter-node hop's group."""
        return [r * self.shards + shard for r in range(self.replicas)]

    def __str__(self) -> str:
        return f"{self.replicas} (replicate) x {self.shards} (shard)"


def node_mesh(world_size: int, local_world_size: int | None) -> MeshShape:
    """shard_group="node": shard over the ranks of one node, replicate across nodes."""
    if local_world_size is None:
        raise ValueError('shard_group="node" needs LOCAL_WORLD_SIZE (set by torchrun) to know how many ranks a '
                         'node has: launch with torchrun, set LOCAL_WORLD_SIZE, or pass mesh=init_device_mesh('
                         '"cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))')
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f'shard_group="node": {world_size} ranks do not split into nodes of LOCAL_WORLD_SIZE='
                         f'{local_world_size} ranks; every node must run the same number of ranks')
    return MeshShape(replicas=world_size // local_world_size, shards=local_world_size)


def param_phase_dtype(requested, shape: MeshShape, nodes: MeshShape | None, model_dtype):
    """The parameters' format across nodes (torch.bfloat16 or "int8") if narrower than the model's, else None;
    refuses, naming the fix."""
    if requested is None:
        return None
    if shape.hybrid:
        raise ValueError("inter_node_param_dtype: hybrid sharding (mesh= / shard_group=) never sends parameters "
                         "across nodes (each node gathers its own); drop inter_node_param_dtype")
    if nodes is None:
        raise ValueError("inter_node_param_dtype narrows the parameters' phase across nodes of node-aware "
                         "collectives, which are off here (one node, LOCAL_WORLD_SIZE = world size, node_aware="
                         "False, or a configuration that falls back to flat collectives): drop it, or run "
                         "ranks on several nodes with node_aware left on")
    if model_dtype != torch.float32:
        raise ValueError(f"inter_node_param_dtype={requested} narrows fp32 parameters; this model is {model_dtype}, "
                         f"whose parameters already cross nodes in that dtype: drop inter_node_param_dtype")
    return requested


def bytes_per_element(fmt: str | None, exact: float = 4.0) -> float:
    """Bytes an element takes on the link in a phase's format (None: `exact`, the dtype's own)."""
    if fmt is None:
        return float(exact)
    if fmt == "bfloat16":
        return 2.0
    if fmt == "int8":
        return 1.0 + 4.0 / INT8_BLOCK
    if fmt == "onebit":  # Note [1-bit format] in onebit.py
        return 1.0 / 8 + 4.0 / ONEBIT_BLOCK
    raise ValueError(f"a phase's format must be None or one of {HOP_DTYPES}, got {fmt!r}")


def hop_link_bytes(shape: MeshShape, grad_bytes: int, hop_dtype: str | None = None,
                   reduce_bytes_per_element: int = 4) -> float:
    """Bytes one node sends per reducing backward (Note [Hybrid sharding]): 2 (R-1)/R of S in the hop's format."""
    if not shape.hybrid:
        return 0.0
    per_element = bytes_per_element(hop_dtype, reduce_bytes_per_element)
    return 2 * (shape.replicas - 1) / shape.replicas * grad_bytes / 4 * per_element


def ring_link_bytes(world_size: int, ranks_per_node: int, grad_bytes: int) -> float:
    """Bytes one node sends over its link for a flat ring all-reduce (DDP): 2 (W-1)/W of the buffer."""
    if world_size == ranks_per_node:
        return 0.0
    return 2 * (world_size - 1) / world_size * grad_bytes


def two_level_link_bytes(nodes: int, grad_bytes: int, hop_dtype: str | None = None,
                         param_dtype: str | None = None, param_gathers: int = 1) -> float:
    """Bytes one node sends per step with node-aware flat sharding of an fp32 model of `grad_bytes` (Note [Two-level
    collectives]): the gradient phase in `hop_dtype`, `param_gathers` parameter phases in `param_dtype`."""
    if nodes <= 1:
        return 0.0
    one_way = hop_link_bytes(MeshShape(nodes, 1), grad_bytes, hop_dtype) / 2
    params = grad_bytes / 4 * bytes_per_element(param_dtype)
    return one_way + param_gathers * (nodes - 1) / nodes * params
