"""Hybrid sharding, the pure part: who shards with whom, who replicates with whom, and what crosses the link.

No process group here (those are built in mesh.py); tests need only numbers.

Note [Hybrid sharding]
----------------------
W ranks form a (replicate R) x (shard K) mesh, W = R * K, rank = replica * K +
shard: the K ranks of one replica are contiguous, which is how torchrun numbers
the ranks of one node, so "a replica is a node". Each replica holds the whole
model sharded K ways exactly as flat ZeRO does over K ranks (the layout is
planned for K); the R replicas hold identical shards. One step:

  backward: each bucket is reduce-scattered inside the replica (fast links),
            then this rank's chunk is all-reduced with the ranks that hold the
            same chunk in the other replicas (the *inter-node hop*, over the slow
            link). All K ranks of a node do their hop at once, each with 1/K of
            the bucket, so the node's link carries the bucket's gradient once:
            2 (R-1)/R * S bytes per node per step for S bytes of gradients, not
            the 2 (W-1)/W * S of a flat ring (which also crosses the link with
            the parameter all-gather after the step);
  step:     each rank steps its chunk, as flat ZeRO;
  gather:   the updated chunks are all-gathered inside the replica only: no
            parameter byte crosses the link.

Gradients are pre-divided by W (not K) while staged, so the intra-node sum and
the inter-node sum together give the average over every rank. Optimizer state,
master weights and gradient shards cost 1/K per rank instead of 1/W: hybrid
trades memory for link bytes. R = 1 is flat sharding over K ranks; K = 1 is
plain data parallelism with a replicated optimizer.

The hop may be compressed (Note [Compressed inter-node hop] in
csrc/comm/replica_hop.h): each rank's chunk leaves in bf16 or int8 (per-block
scales, error feedback), the sum is formed in fp32 by the rank that owns that
part, and goes back out in the same format. Exact inside the node, rounded on
the way across.

Note [Two-level collectives]
----------------------------
Flat sharding over W = R * K ranks on R nodes of K ranks keeps optimizer state
at 1/W, but a flat ring's reduce-scatter and all-gather each cross a node's
link with (W-1)/W of the gradient: 2 (W-1)/W * S bytes per node per step, as
DDP. Node-aware ("two-level") collectives send the hybrid's bytes instead:

  reduce:  a reduce-scatter inside the node (fast links) leaves local rank j
           with the node's sum of node chunk j (1/K of the bucket); then phase 1
           of the inter-node hop (Note [Compressed inter-node hop]) among the R
           ranks with local rank j leaves node i's rank with part i of it (1/W
           of the bucket) summed over every rank: its chunk (Note [Node-aware
           chunk order] in layout.py). Each rank sends (R-1)/R of its node
           chunk: a node's K ranks together (R-1)/R * S.
  step:    on 1/W, as flat sharding.
  gather:  the mirror: the R ranks with local rank j all-gather their parts
           into node chunk j (phase 2 without a reduction: (R-1)/R * S per node,
           in the parameters' dtype), then each node all-gathers its K node
           chunks inside the node.

Per node 2 (R-1)/R * S, the hybrid's, with flat's memory. The gradient phase
may be compressed (inter_node_dtype: bf16, or int8 with error feedback); the
parameter phase is exact unless asked (Note [Parameters across nodes in
bf16]), and either way every rank holds the same parameters bit for bit.

Stage 3 keeps only its 1/W chunk of the parameters and gathers a bucket
before each use, in forward and again in backward (Note [Stage-3 schedule] in
zero3/schedule.py): both gathers are this two-level gather (csrc/comm/two_level.h,
on groups of the parameter shard's own, beside the engine's reductions), so a
node sends 3 (R-1)/R * S per step (gradient phase + two parameter gathers; less
the buckets backward starts with, gathered once: Note [The seam between
forward and backward] in zero3/store.py) where a flat ring sends
3 (W-1)/W * S, with parameters, gradients and optimizer state at 1/W.

Exactness: every sum is the fp32 sum of the same W addends as a flat ring's,
only grouped differently (node sums first), so results equal flat sharding's
up to summation order: the parity bar is that of any two reduction orders
(a few ulps of the gradient per step), not bitwise.

Note [Parameters across nodes in bf16]
--------------------------------------
Once the gradient phase is compressed (bf16: (R-1)/R * S/2 per node), the
parameter phase is most of what crosses the link: (R-1)/R * S in fp32, two
thirds of the 12.7 MB per step of a 17 MB model at 2 x 2. With
inter_node_param_dtype=torch.bfloat16 it crosses in bf16, halving it. Sending
a rounded chunk alone would leave the owner with its fp32 values and every
other rank with their rounding: the ranks' models would differ. So the model
itself holds every parameter rounded to bf16, on every rank, owner included,
and the optimizer keeps fp32 master values of its own 1/W (as for a bf16
model: Note [Master weights] in master_step.py), rounding them into the
model after each step. The model stays fp32 (its activations, gradients and
reductions too); only its weights take bf16 values, as in bf16 mixed
precision with fp32 masters (DeepSpeed's ZeRO++ quantizes the weights it
gathers in the same way, to int8). Memory: +4 bytes per parameter / W for
the master. Every rank holds the same parameters bit for bit; against the
exact run, the difference is that of training with bf16-rounded weights.
Built for node-aware flat sharding at stages 1-2 (hybrid sharding sends no
parameter across nodes; stage 3's gathers are its own).
"""
from __future__ import annotations

import dataclasses

import torch

# What the inter-node hop carries: None (the reduction dtype, exact), or a compressed format.
HOP_DTYPES = ("bfloat16", "int8", "onebit")
# int8 hop: one fp32 scale per this many elements (Note [Compressed inter-node hop]); the same as
# kInt8Block in csrc/comm/int8_kernel.h.
INT8_BLOCK = 256
# OneBitAdam's block (shardopt/onebit.py ONEBIT_BLOCK; this module stays free of imports).
ONEBIT_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A (replicate, shard) mesh over ranks 0..W-1, rank = replica * shards + shard."""

    replicas: int
    """R: copies of the sharded model (nodes, with shard_group="node")."""
    shards: int
    """K: ranks one copy is sharded over (the ranks of a node)."""

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
    """The dtype the parameter gather's phase across nodes carries if narrower than the model's, or None
    (Note [Parameters across nodes in bf16]); refuses what cannot work, naming the fix (stage 3, which
    gathers on its own schedule, ShardConfig refuses)."""
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


def hop_link_bytes(shape: MeshShape, grad_bytes: int, hop_dtype: str | None = None,
                   reduce_bytes_per_element: int = 4) -> float:
    """Bytes one node sends over its link per reducing backward (the arithmetic, headers excluded).

    Every rank sends (R-1)/R of its chunk in each of the hop's two phases (Note
    [Compressed inter-node hop]); a node's K ranks together send 2 (R-1)/R of
    the gradient, in the hop's format.
    """
    if not shape.hybrid:
        return 0.0
    elements = grad_bytes / 4
    if hop_dtype is None:
        per_element = float(reduce_bytes_per_element)
    elif hop_dtype == "bfloat16":
        per_element = 2.0
    elif hop_dtype == "int8":
        per_element = 1.0 + 4.0 / INT8_BLOCK  # one fp32 scale per block
    elif hop_dtype == "onebit":  # OneBitAdam's compression stage (Note [1-bit format] in onebit.py)
        per_element = 1.0 / 8 + 4.0 / ONEBIT_BLOCK
    else:
        raise ValueError(f"hop dtype must be None or one of {HOP_DTYPES}, got {hop_dtype!r}")
    return 2 * (shape.replicas - 1) / shape.replicas * elements * per_element


def ring_link_bytes(world_size: int, ranks_per_node: int, grad_bytes: int) -> float:
    """Bytes one node sends over its link for a flat ring all-reduce (DDP) of grad_bytes.

    A ring over W ranks numbered node by node crosses each node's link once per
    direction; the edge carries 2 (W-1)/W of the buffer.
    """
    if world_size == ranks_per_node:
        return 0.0
    return 2 * (world_size - 1) / world_size * grad_bytes



def two_level_link_bytes(nodes: int, grad_bytes: int, hop_dtype: str | None = None,
                         param_bytes: int | None = None, param_gathers: int = 1) -> float:
    """Bytes one node sends over its link per step with node-aware flat sharding (Note [Two-level collectives]).

    (R-1)/R of the gradient in the hop's format, then (R-1)/R of the parameters
    (param_bytes; default grad_bytes) in their own dtype, param_gathers times
    (stage 3: 2, before forward and before backward).
    """
    if nodes <= 1:
        return 0.0
    one_way = hop_link_bytes(MeshShape(nodes, 1), grad_bytes, hop_dtype) / 2
    return one_way + param_gathers * (nodes - 1) / nodes * (grad_bytes if param_bytes is None else param_bytes)
