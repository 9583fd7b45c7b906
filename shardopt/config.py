"""Frozen configuration of a ShardedOptimizer, validated once at construction."""
from __future__ import annotations

import dataclasses

import torch

from shardopt.precision import NONFINITE_ACTIONS, LossScaleConfig

# Note [Default bucket sizes]
# A bucket is the unit of overlap and, in stage 2, of transient full-size
# gradient memory (num_staging_buffers buckets exist at once). One bucket for
# the whole model means no overlap and no stage-2 saving; tiny buckets pay the
# per-collective latency. Measured (benchmarks/results/2026-11-22-bucket-sweep.md,
# 29.5M-parameter GPT, ZeRO-2, 2 gloo ranks on 2 CPU cores, step time / DDP's):
#     bucket (elements)   0.25M   1M     4M     16M    64M
#     8x128 tokens        1.12    0.88   0.85   0.94   0.99
#     1x16 tokens         1.59    1.02   0.91   0.84   0.83
# Below ~2M elements per-collective latency dominates; from 4M to 64M the
# step is flat within noise, and memory favours the small end. So by default
# (None) a model is cut into about AUTO_BUCKETS buckets, clamped to
# [AUTO_MIN, AUTO_MAX] elements (DeepSpeed's default, 5e8, is one bucket for
# most models: no overlap, and a full-size staging buffer).
AUTO_BUCKETS = 8
AUTO_MIN = 2_000_000        # 8 MB of fp32
AUTO_MAX = 25_000_000       # 100 MB of fp32

# Note [Default bucket sizes across nodes]
# With node-aware collectives (ranks on several nodes: Note [Two-level
# collectives] in parallel/mesh_plan.py) the link between nodes, not the
# per-collective latency inside one, sets the pace: what backward leaves
# exposed is the last bucket's inter-node phase, so smaller buckets start the
# link sooner and leave a shorter tail. Measured on the emulated cluster (2 nodes
# x 2 ranks, 1 Gbit/s, GPT 'small' of 4.3M parameters, batch 2x64, one run;
# benchmarks/results/2026-11-25-node-aware.md), ZeRO-2 step time / DDP's:
#     bucket (elements)             0.5M    1M     2M (the one-host default here)
#     node-aware, fp32              0.67    0.75   0.87
#     node-aware, bf16 inter-node   0.66    -      0.73
# So across nodes the floor is AUTO_MIN_NODES instead of AUTO_MIN (the model is
# still cut into about AUTO_BUCKETS buckets, so big models keep big buckets).
AUTO_MIN_NODES = 500_000    # 2 MB of fp32
DEFAULT_REDUCE_BUCKET_SIZE = None
DEFAULT_ALLGATHER_BUCKET_SIZE = None


# Stage 3 gathers a bucket's full parameters for its use, so the bucket is also
# the unit of parameter memory alive at once (about prefetch + 1 buckets): twice
# as many, smaller buckets keep that near an eighth of the model.
AUTO_BUCKETS_STAGE3 = 16
AUTO_MIN_STAGE3 = 500_000


def auto_bucket_size(total_numel: int, stage: int = 2, across_nodes: bool = False) -> int:
    """The default bucket size for a model of total_numel trainable elements (across_nodes: with node-aware
    collectives; Note [Default bucket sizes across nodes])."""
    if stage == 3:
        return max(AUTO_MIN_STAGE3, min(AUTO_MAX, -(-total_numel // AUTO_BUCKETS_STAGE3)))
    return max(AUTO_MIN_NODES if across_nodes else AUTO_MIN, min(AUTO_MAX, -(-total_numel // AUTO_BUCKETS)))

STAGES = (1, 2, 3)
OFFLOADS = ("none", "cpu")
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMM_IMPLS = ("auto", "native", "ring")
INTER_NODE_DTYPES = (None, torch.bfloat16, "int8")


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    """How parameters, gradients and optimizer state are sharded and communicated."""

    stage: int = 2
    """1: shard optimizer state; full-size gradients persist in one flat buffer.
    2: also shard gradients: a bucket's full-size gradient memory is reused as
    soon as it is reduce-scattered; each rank keeps only its gradient chunks.
    3: also shard parameters: a bucket's full parameters exist only while a
    forward or backward uses them (zero3/, Note [Stage-3 schedule] in zero3/schedule.py)."""
    reduce_bucket_size: int | None = DEFAULT_REDUCE_BUCKET_SIZE
    """Elements per gradient bucket: one reduce-scatter each (rounded up to a
    multiple of lcm(world_size, 128)). None: see Note [Default bucket sizes] (and
    Note [Default bucket sizes across nodes] with node-aware collectives)."""
    allgather_bucket_size: int | None = DEFAULT_ALLGATHER_BUCKET_SIZE
    """Elements per parameter all-gather after a step. All-gathers never span two
    reduce buckets, so values above reduce_bucket_size gather whole buckets.
    None: the same as the reduce bucket size."""
    overlap_comm: bool = True
    """Launch a bucket's reduce-scatter from backward as soon as all its
    gradients exist, and wait only when its staging buffer is needed again or
    backward ends. False: reduce each bucket synchronously when it fills."""
    overlap_gather: bool = False
    """After a step, gather the updated parameters during the next forward
    (each module waits for its own buckets) instead of inside step(). Faster,
    but parameters read outside a forward before it must be waited for with
    opt.wait_params() (Note [Gathering in the next forward] in prefetch.py)."""
    offload: str = "none"
    """Where this rank's fp32 master chunks, gradient chunks and optimizer state
    live: "none" (with the model) or "cpu" (host memory; the step runs there,
    on shardopt.CPUAdam by default). None is taken as "none" (FSDP's
    cpu_offload=None, a DeepSpeed "offload_optimizer" left null)."""
    pin_memory: bool = True
    """With offload="cpu" and a CUDA model: pin the host chunks (faster,
    asynchronous copies). Ignored on CPU-only machines."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduced in (float32, bfloat16 or float16). None:
    float32, whatever the model's dtype."""
    loss_scale: object = "auto"
    """"auto" (dynamic scaling for fp16 models, none otherwise), "dynamic",
    None, a number (static scale) or a shardopt.LossScaleConfig."""
    nonfinite: str = "auto"
    """When a gradient holds inf/nan on any rank: "skip" (every rank skips the
    step; with fp16 the scale backs off), "raise" (every rank raises), or
    "auto" (skip with a loss scaler, raise otherwise)."""
    max_grad_norm: float | None = None
    """If set, step() first clips the global gradient norm to this value."""
    num_staging_buffers: int = 2
    """Stage 2: bucket-sized staging buffers reused round-robin (2 = one bucket
    filling while the previous one is reduced)."""
    comm_impl: str = "auto"
    """Collectives: "native" (the process group's), "ring" (shardopt's point-to-point
    ring), "auto" (ring on gloo, native elsewhere)."""
    reshard_after_forward: bool = True
    """Stage 3: free a bucket's full parameters once the forward has used them
    and gather them again for backward (least memory). False keeps them from
    the forward to the end of its backward (one gather per step instead of two)."""
    prefetch_bucket_size: int | None = None
    """Stage 3: elements gathered ahead of the bucket a module waits for
    (DeepSpeed's stage3_prefetch_bucket_size). None: one bucket ahead."""
    max_live_parameters: int | None = None
    """Stage 3: prefetching stops while this many elements of full parameters
    are gathered (DeepSpeed's stage3_max_live_parameters); a bucket a module
    needs is always gathered. None: no bound beyond the prefetch."""
    param_persistence_threshold: int = 0
    """Stage 3: parameters with at most this many elements stay gathered on
    every rank (DeepSpeed's stage3_param_persistence_threshold; Note [Stage-3
    buckets hold whole parameters] in layout.py)."""
    node_aware: bool | None = None
    """Flat sharding over ranks that span nodes: reduce-scatter inside each node,
    then across nodes on 1/K of it, and the mirror for the parameter all-gather
    (Note [Two-level collectives] in parallel/mesh_plan.py): a node's link
    carries 2 (R-1)/R of the gradient bytes per step instead of 2 (W-1)/W (stage
    3, which gathers parameters twice: 3 (R-1)/R instead of 3 (W-1)/W), with
    optimizer state (and stage 3's parameters) still 1/W. None: on when
    LOCAL_WORLD_SIZE < world size (as torchrun sets it) and built for this run
    (CPU/gloo, not OneBitAdam; otherwise flat, said once in the log); True:
    required (refused where not built); False: flat collectives."""
    inter_node_dtype: object = None
    """Hybrid sharding, or node-aware flat sharding: what the inter-node hop (its gradient phase) carries. None: the reduction
    dtype (exact); torch.bfloat16: half the bytes; "int8": about a quarter, with
    per-block scales and error feedback (Note [Compressed inter-node hop] in
    csrc/comm/replica_hop.h)."""
    inter_node_param_dtype: object = None
    """Node-aware flat sharding (stages 1-2, an fp32 model): what the parameter
    gather's phase across nodes carries. None: the parameters' dtype (exact);
    torch.bfloat16: half those bytes, and every rank's model then holds each
    parameter rounded to bf16 (the same on every rank) while the optimizer
    steps fp32 master values of its 1/W (Note [Parameters across nodes in
    bf16] in parallel/mesh_plan.py)."""
    shared_memory_gather: bool | None = None
    """A CPU model, the ranks that gather on one host (every rank, or a hybrid
    mesh's shard group inside a node). Stages 1-2: the flat parameter buffers
    live in shared memory and the gather after a step copies the other ranks'
    chunks out of them instead of sending them through the process group (Note
    [Gathering through shared memory] in parallel/shared_flat.py). Stage 3: each
    rank's shard lives there and a bucket's gather copies every rank's chunk
    out of it (Note [Stage 3's gathers through shared memory] in
    zero3/shared_shard.py). None: wherever that is possible; True: required
    (raises, saying why, where not); False: never."""

    def __post_init__(self):
        if self.offload is None:
            object.__setattr__(self, "offload", "none")
        if self.stage not in STAGES:
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")
        for field in ("prefetch_bucket_size", "max_live_parameters"):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{field} must be None or a whole number of elements >= 0, got {v!r}")
        v = self.param_persistence_threshold
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"param_persistence_threshold must be a whole number of elements >= 0, got {v!r}")
        if self.stage == 3 and not self.overlap_comm:
            raise ValueError("stage 3 needs overlap_comm=True: a backward that waited for each reduce-scatter "
                             "could wait for a rank that is itself waiting for a parameter gather (Note [Stage 3 "
                             "never waits in backward] in csrc/comm/bucket_engine.cpp)")
        if self.stage == 3 and self.overlap_gather:
            raise ValueError("overlap_gather is stage 1/2's way to hide the gather after a step; stage 3 gathers "
                             "each bucket just before the modules that use it (with prefetch): drop "
                             "overlap_gather=True")
        for field in ("reduce_bucket_size", "allgather_bucket_size"):
            v = getattr(self, field)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{field} must be a positive whole number of elements, got {v!r} "
                                 f"(e.g. {field}=int(5e7))")
        if not isinstance(self.overlap_comm, bool):
            raise TypeError(f"overlap_comm must be True or False, got {self.overlap_comm!r}")
        if not isinstance(self.overlap_gather, bool):
            raise TypeError(f"overlap_gather must be True or False, got {self.overlap_gather!r}")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {OFFLOADS}, got {self.offload!r}")
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"pin_memory must be True or False, got {self.pin_memory!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be None or one of {REDUCE_DTYPES}, got {self.reduce_dtype!r}")
        if not (self.loss_scale in ("auto", "dynamic", None) or isinstance(self.loss_scale, LossScaleConfig)
                or (isinstance(self.loss_scale, (int, float)) and not isinstance(self.loss_scale, bool)
                    and self.loss_scale > 0)):
            raise ValueError(f"loss_scale must be 'auto', 'dynamic', None, a number > 0 or a "
                             f"shardopt.LossScaleConfig, got {self.loss_scale!r}")
        if self.nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"nonfinite must be one of {NONFINITE_ACTIONS}, got {self.nonfinite!r}")
        if self.max_grad_norm is not None and (isinstance(self.max_grad_norm, bool)
                                               or not isinstance(self.max_grad_norm, (int, float))
                                               or not self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be None or a number > 0, got {self.max_grad_norm!r}")
        if isinstance(self.num_staging_buffers, bool) or not isinstance(self.num_staging_buffers, int) \
                or self.num_staging_buffers < 1:
            raise ValueError(f"num_staging_buffers must be >= 1, got {self.num_staging_buffers!r}")
        if self.comm_impl not in COMM_IMPLS:
            raise ValueError(f"comm_impl must be one of {COMM_IMPLS}, got {self.comm_impl!r}")
        if self.node_aware not in (None, True, False):
            raise TypeError(f"node_aware must be None (automatic), True or False, got {self.node_aware!r}")
        if self.inter_node_dtype not in INTER_NODE_DTYPES:
            raise ValueError(f"inter_node_dtype must be None (exact), torch.bfloat16 or 'int8', got "
                             f"{self.inter_node_dtype!r}")

        if self.shared_memory_gather not in (None, True, False):
            raise TypeError(f"shared_memory_gather must be None (where possible), True or False, got "
                            f"{self.shared_memory_gather!r}")
        if self.inter_node_param_dtype not in (None, torch.bfloat16):
            raise ValueError(f"inter_node_param_dtype must be None (the parameters' dtype) or torch.bfloat16, got "
                             f"{self.inter_node_param_dtype!r}")
        # Stage 3's store gathers each bucket for its use, on its own schedule (zero3/): the flat gather's
        # phase across nodes does not exist there.
        if self.stage == 3 and self.inter_node_param_dtype is not None:
            raise NotImplementedError("inter_node_param_dtype is built for stages 1-2 (stage 3 gathers parameters "
                                      "bucket by bucket on its own schedule); drop it or use stage=2")

    def hop_format(self) -> str:
        """The inter-node hop's format for the bucket engine."""
        return {None: "exact", torch.bfloat16: "bfloat16", "int8": "int8"}[self.inter_node_dtype]

    def signature(self) -> list[str]:
        return [f"config {f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)]
