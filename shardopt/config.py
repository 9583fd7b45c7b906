"""Frozen configuration of a ShardedOptimizer, validated once at construction."""
from __future__ import annotations

import dataclasses

import torch

from shardopt.precision import NONFINITE_ACTIONS, LossScaleConfig
from shardopt.tiers.disk import AioConfig

# Note [Default bucket sizes]
# A model is cut into about AUTO_BUCKETS buckets of [AUTO_MIN, AUTO_MAX] elements: below ~2M per-collective
# latency dominates, from 4M to 64M step time is flat (measured in benchmarks/results/) and smaller holds less.
# Across nodes the last bucket's inter-node phase is exposed (a lower floor); stage 3's buckets also bound gathers.
AUTO_BUCKETS = 8
AUTO_MIN = 2_000_000        # 8 MB of fp32
AUTO_MAX = 25_000_000       # 100 MB of fp32
AUTO_MIN_NODES = 500_000    # 2 MB of fp32
DEFAULT_REDUCE_BUCKET_SIZE = None
DEFAULT_ALLGATHER_BUCKET_SIZE = None

AUTO_BUCKETS_STAGE3 = 16
AUTO_MIN_STAGE3 = 500_000


def auto_bucket_size(total_numel: int, stage: int = 2, across_nodes: bool = False) -> int:
    """The default bucket size for a model of total_numel trainable elements (Note [Default bucket sizes])."""
    if stage == 3:
        return max(AUTO_MIN_STAGE3, min(AUTO_MAX, -(-total_numel // AUTO_BUCKETS_STAGE3)))
    return max(AUTO_MIN_NODES if across_nodes else AUTO_MIN, min(AUTO_MAX, -(-total_numel // AUTO_BUCKETS)))

STAGES = (1, 2, 3)
OFFLOADS = ("none", "cpu", "nvme")
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMM_IMPLS = ("auto", "native", "ring")
INTER_NODE_DTYPES = (None, torch.bfloat16, "int8")
PARAM_PHASE_DTYPES = (None, torch.bfloat16, "int8")


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    """How parameters, gradients and optimizer state are sharded and communicated."""

    stage: int = 2
    """1: shard optimizer state; 2: also gradients (each rank keeps its chunks once a bucket is reduced); 3: also
    parameters, gathered only while a forward or backward uses them (Note [Stage-3 schedule] in zero3/schedule.py)."""
    reduce_bucket_size: int | None = DEFAULT_REDUCE_BUCKET_SIZE
    """Elements per gradient bucket (rounded up to a multiple of lcm(world_size, 128)); None: Note [Default
    bucket sizes]."""
    allgather_bucket_size: int | None = DEFAULT_ALLGATHER_BUCKET_SIZE
    """Elements per parameter all-gather after a step, within one reduce bucket. None: the reduce bucket size."""
    overlap_comm: bool = True
    """Launch a bucket's reduce-scatter from backward once its gradients exist (False: reduce it synchronously)."""
    overlap_gather: bool = False
    """Gather the updated parameters during the next forward instead of inside step(); parameters read outside
    a forward before it need opt.wait_params() (Note [Gathering in the next forward] in prefetch.py)."""
    offload: str = "none"
    """"none" (or None): with the model; "cpu": this rank's masters, gradient chunks and optimizer state in host
    memory, and the step runs there (on shardopt.CPUAdam by default); "nvme": the same, kept in a file in
    `nvme_path` between steps and walked bucket by bucket (Note [Tiers] in tiers/__init__.py)."""
    offload_param: str = "none"
    """Stage 3: where this rank's parameter shard lives between gathers: "none" (with the model), "cpu" (host
    memory) or "nvme" (a file in `nvme_path`, read ahead of each bucket's gather)."""
    nvme_path: str | None = None
    """The directory (on a local disk) of the "nvme" tiers' scratch files: one per rank and tier, gone at exit."""
    offload_buffer_count: int = 4
    """Buffers of a disk tier (DeepSpeed's buffer_count): the optimizer state's ring holds this many buckets'
    records (one in use, one written behind, the rest read ahead: Note [The ring's walk] in tiers/ring.py); the
    parameter tier reads this many buckets ahead of a gather."""
    aio: object = None
    """The disk tiers' I/O: a shardopt.tiers.disk.AioConfig or a dict of its fields (DeepSpeed's aio block)."""
    pin_memory: bool = True
    """With offload="cpu" and a CUDA model: pin the host chunks (faster, asynchronous copies)."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduced in (float32, bfloat16 or float16). None: float32, whatever the model's."""
    loss_scale: object = "auto"
    """"auto" (dynamic for fp16 models), "dynamic", None, a number (static) or a shardopt.LossScaleConfig."""
    nonfinite: str = "auto"
    """On inf/nan on any rank: "skip" (every rank skips the step), "raise", or "auto" (skip when loss-scaled)."""
    max_grad_norm: float | None = None
    """If set, step() first clips the global gradient norm to this value."""
    num_staging_buffers: int = 2
    """Stage 2: bucket-sized staging buffers reused round-robin (2: one fills while the previous one reduces)."""
    comm_impl: str = "auto"
    """"native" (the process group's collectives), "ring" (shardopt's), "auto" (ring on gloo, native elsewhere)."""
    reshard_after_forward: bool = True
    """Stage 3: free parameters after forward and gather them again for backward; False keeps them (one gather)."""
    prefetch_bucket_size: int | None = None
    """Stage 3: elements gathered ahead of the bucket a module waits for. None: one bucket ahead."""
    max_live_parameters: int | None = None
    """Stage 3: prefetching stops while this many elements are gathered (a bucket needed is always gathered)."""
    param_persistence_threshold: int = 0
    """Stage 3: parameters of at most this many elements stay gathered (Note [Stage-3 buckets hold whole
    parameters] in layout.py)."""
    node_aware: bool | None = None
    """Two-level collectives across nodes (Note [Two-level collectives] in parallel/mesh_plan.py). None: on when
    LOCAL_WORLD_SIZE < world size and built for this run; True: required; False: flat collectives."""
    inter_node_dtype: object = None
    """What the gradients' inter-node hop carries: None (exact), torch.bfloat16 (half the bytes) or "int8" (a
    quarter, with error feedback: Note [Compressed inter-node hop] in csrc/comm/replica_hop.h)."""
    inter_node_param_dtype: object = None
    """Node-aware flat sharding of an fp32 model: what the parameter gathers carry across nodes: None (exact),
    torch.bfloat16 (Note [Parameters across nodes in bf16] in parallel/mesh_plan.py) or, at stage 3, "int8"
    (block-scaled: Note [Stage 3's parameters across nodes, rounded] there)."""
    shared_memory_gather: bool | None = None
    """Gather through shared memory where the ranks share a host (Note [Gathering through shared memory] in
    parallel/shared_memory.py). None: wherever possible; True: required; False: never."""

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
        if self.offload_param is None:
            object.__setattr__(self, "offload_param", "none")
        if self.offload_param not in OFFLOADS:
            raise ValueError(f"offload_param must be one of {OFFLOADS}, got {self.offload_param!r}")
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"offload_param={self.offload_param!r} moves stage 3's parameter shard; at stage "
                             f"{self.stage} every rank holds whole parameters with the model: use stage=3, or "
                             f"offload={self.offload_param!r} for the optimizer's state")
        if self.offload_param == "nvme" and self.offload == "none":
            raise ValueError("offload_param='nvme' needs offload='cpu' or 'nvme': the step then writes each "
                             "bucket's updated chunk from separate master weights (as DeepSpeed's ZeRO-Infinity "
                             "pairs offload_param with offload_optimizer)")
        on_disk = "nvme" in (self.offload, self.offload_param)
        if on_disk and not self.nvme_path:
            raise ValueError("offload or offload_param 'nvme' needs nvme_path: a directory on a local disk for "
                             "this rank's scratch files")
        if self.nvme_path is not None and not on_disk:
            raise ValueError(f"nvme_path={self.nvme_path!r} is used only by offload='nvme' or "
                             f"offload_param='nvme'; drop it, or choose one of them")
        v = self.offload_buffer_count
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"offload_buffer_count must be a whole number >= 1, got {v!r}")
        if self.aio is None or isinstance(self.aio, dict):
            object.__setattr__(self, "aio", AioConfig(**(self.aio or {})))
        elif not isinstance(self.aio, AioConfig):
            raise TypeError(f"aio must be None, a dict or a shardopt.tiers.disk.AioConfig, got {self.aio!r}")
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
        if self.inter_node_param_dtype not in PARAM_PHASE_DTYPES:
            raise ValueError(f"inter_node_param_dtype must be None (the parameters' dtype), torch.bfloat16 or "
                             f"'int8' (stage 3), got {self.inter_node_param_dtype!r}")
        if self.inter_node_param_dtype == "int8" and self.stage != 3:
            raise ValueError(f"inter_node_param_dtype='int8' is built for stage 3, whose shard is the master and "
                             f"whose gathers round every chunk alike; at stage {self.stage} use torch.bfloat16 "
                             f"(or stage=3)")

    @property
    def keeps_full_grads(self) -> bool:
        """Whether full-size gradients persist in one flat buffer until the step (stage 1)."""
        return self.stage == 1

    @property
    def offloaded(self) -> bool:
        """Whether the optimizer's state lives on the host (offload "cpu", or "nvme" between steps)."""
        return self.offload != "none"

    def hop_format(self) -> str:
        """The inter-node hop's format for the bucket engine."""
        return {None: "exact", torch.bfloat16: "bfloat16", "int8": "int8"}[self.inter_node_dtype]

    def param_phase_format(self) -> str:
        """The parameter gathers' format across nodes: "exact", "bfloat16" or "int8"."""
        return {None: "exact", torch.bfloat16: "bfloat16", "int8": "int8"}[self.inter_node_param_dtype]

    def signature(self) -> list[str]:
        """What every rank must agree on: every field but nvme_path (each rank's own disk, which may differ)."""
        return [f"config {f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name != "nvme_path"]
