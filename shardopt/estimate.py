"""Memory per rank of a ShardedOptimizer before building one: pure arithmetic on the real layout.

The estimate plans the same flat layout the optimizer would (`plan_layout`,
same bucket sizes, same padding) and counts what `ShardedOptimizer.memory_stats()`
counts, under the same names:

    params           the flat parameter buffer: every trainable element plus the
                     padding of each region's last bucket, in the model's dtype;
                     stage 3: this rank's chunks plus the buckets gathered at
                     once (Note [Estimate for stage 3])
    grads            stage 2: this rank's gradient chunks (fp32); stage 1: also the
                     full-size flat gradient buffer (model dtype)
    optimizer_state  state tensors of the inner optimizer over this rank's pieces
                     (padding has no state; fp32); e.g. 2 per element for Adam
    staging          the bucket engine's slots, min(num_staging_buffers, buckets) of
                     them: a bucket-sized buffer in the reduce dtype when gradients
                     are copied to be reduced (stage 2, or a dtype change), and a
                     chunk-sized output buffer when results cannot land in the
                     gradient shard directly (offload, or a reduce dtype other than fp32)
    master           fp32 master chunks, when they are not the parameters themselves
                     (bf16/fp16 parameters, or offload="cpu")
    offloaded        with offload="cpu": master, gradient chunks and optimizer state
    on_device        everything else (what stays with the model), but
    onebit           with optimizer "onebit": OneBitAdam's compression state, host memory
                     (Note [Estimate for 1-bit Adam])

Model states only, as DeepSpeed's estimate_zero2_model_states_mem_needs:
activations, the allocator's slack and the framework itself come on top.

Note [Estimate for mixed precision and offload]
-----------------------------------------------
As ShardedOptimizer allocates (Note [Master weights] in master_step.py, Note
[Bucket engine] in csrc/comm/bucket_engine.h): fp32 master chunks of this
rank's shard for bf16/fp16 parameters or offload; master, gradient chunks and
optimizer state on the host with offload; gradient chunks fp32, staging in the
reduce dtype (fp32 by default). tests/test_estimate.py checks every case
against memory_stats(). Not counted: the output buffers the engine adds when
gradients accumulate over several backward passes without no_sync.

Note [Estimate for stage 3]
---------------------------
At stage 3 a rank keeps 1/N of the parameters (its chunks) and gathers a
bucket's full parameters only while modules use it (Note [Stage-3 schedule]
in zero3/schedule.py): the one in use and `prefetch` ahead, `live_buckets` in all,
of the largest bucket's size. The estimate counts that peak as parameters;
memory_stats() counts what is gathered at the moment it is called (between
steps: nothing but persistent buckets); `opt.store.peak_live` is the peak.
So weights + gradients + Adam state per rank come to 16P/N bytes in fp32
(4 + 4 + 8 per element), plus the live buckets and the staging buffers.
The staging pool may grow past num_staging_buffers at stage 3 (Note [Stage 3
never waits in backward] in csrc/comm/bucket_engine.cpp): the estimate counts
the buffers allocated up front.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Callable, Sequence

import torch

from shardopt import onebit as _onebit
from shardopt.config import auto_bucket_size
from shardopt.layout import place_chunks, plan_layout, stage3_page_numel

# Optimizer state elements per parameter element (tensors with more than one element, which is what
# memory_stats() counts: scalar step counters are left out).
STATE_PER_ELEMENT = {
    "adamw": 2, "adam": 2, "cpuadam": 2, "adamax": 2, "nadam": 2, "radam": 2, "adadelta": 2,
    "sgd": 0, "sgd-momentum": 1, "adagrad": 1, "rmsprop": 1,
    "onebit": 2,  # OneBitAdam: Adam's two, plus its compression state (MemoryEstimate.onebit)
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class EstimateConfig:
    """The ShardedOptimizer settings an estimate is for."""

    world_size: int = 2
    """Ranks of the run."""
    shards: int | None = None
    """Hybrid sharding: ranks one copy of the model is sharded over (the ranks of
    a node); the world holds world_size / shards replicas. None: world_size (flat)."""
    node_aware: bool = False
    """With `shards` (the ranks per node): flat sharding over every rank with
    node-aware collectives instead of hybrid sharding (Note [Two-level
    collectives] in parallel/mesh_plan.py): state (and stage 3's parameter
    chunks) 1/world_size; an int8 inter-node phase keeps a residual per node
    chunk (1 + 1/nodes fp32 values per 1/shards of the model), and each bucket in
    flight holds a node chunk. Stage 3's two-level parameter gathers write in
    place: nothing more."""
    inter_node_param_dtype: str | None = None
    """With node_aware at stages 1-2 and fp32 parameters: "bfloat16" sends the
    parameters across nodes in bf16, and keeps fp32 master chunks (Note
    [Parameters across nodes in bf16] in parallel/mesh_plan.py): 4 bytes per
    shard element more."""
    inter_node_dtype: str | None = None
    """Hybrid sharding: "int8" keeps an error-feedback residual (1 + 1/replicas
    fp32 values per shard element); None and "bfloat16" keep nothing."""
    stage: int = 2
    """1: full gradients on every rank; 2: gradient chunks only; 3: parameter chunks too."""
    live_buckets: int = 2
    """Stage 3: buckets gathered at once (the one in use and the prefetched one)."""
    offload: str = "none"
    """"cpu": master chunks and optimizer state on the host."""
    param_dtype: torch.dtype = torch.float32
    """The model's parameter dtype."""
    optimizer: str = "adamw"
    """A key of STATE_PER_ELEMENT."""
    reduce_bucket_size: int | None = None
    """As ShardedOptimizer's; None: the default (auto_bucket_size)."""
    allgather_bucket_size: int | None = None
    """As ShardedOptimizer's (it does not change memory; kept so a layout can be rebuilt exactly)."""
    num_staging_buffers: int = 2
    """As ShardedOptimizer's."""
    reduce_dtype: torch.dtype | None = None
    """As ShardedOptimizer's (None: fp32, or the parameters' dtype if wider)."""
    device: str = "cuda"
    """The model's device type. With offload to a CPU model's host memory, reduced
    gradients land in the (host) shard directly; from an accelerator they need an
    output buffer per staging slot first."""

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.shards is not None and (self.shards < 1 or self.world_size % self.shards):
            raise ValueError(f"shards must divide world_size ({self.world_size}), got {self.shards}")
        if self.node_aware and (self.shards is None or self.shards == self.world_size):
            raise ValueError("node_aware needs shards (ranks per node, --ranks-per-node) below world_size")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage}")
        if self.inter_node_param_dtype not in (None, "bfloat16"):
            raise ValueError(f"inter_node_param_dtype must be None or 'bfloat16', got {self.inter_node_param_dtype!r}")
        if self.inter_node_param_dtype is not None and (not self.node_aware or self.stage == 3
                                                        or self.param_dtype != torch.float32):
            raise ValueError("inter_node_param_dtype needs node_aware, stage 1 or 2 and fp32 parameters (as "
                             "ShardedOptimizer's)")
        if self.offload not in ("none", "cpu"):
            raise ValueError(f"offload must be 'none' or 'cpu', got {self.offload!r}")
        if self.optimizer not in STATE_PER_ELEMENT:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; one of {', '.join(STATE_PER_ELEMENT)}")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds; keys as ShardedOptimizer.memory_stats()."""

    params: int
    """Flat parameter buffer (model dtype, padding included)."""
    grads: int
    """Gradient chunks, plus the full flat gradient buffer at stage 1."""
    optimizer_state: int
    """Inner optimizer state over this rank's pieces."""
    staging: int
    """Stage-2 bucket staging buffers."""
    master: int
    """fp32 master chunks separate from the parameters (0 for fp32 without offload)."""
    host: int
    """How many of the bytes above live on the host because of offload="cpu"."""
    hop_residual: int = 0
    """The int8 inter-node hop's error feedback (hybrid sharding)."""
    gathered: int = 0
    """Stage 3: the part of `params` that is buckets gathered at once (Note [Estimate for stage 3])."""
    in_flight: int = 0
    """Node-aware collectives: the part of `staging` that is the node chunks of buckets being reduced,
    allocated per bucket in backward (memory_stats(), between steps, does not see them)."""
    onebit: int | None = None
    """OneBitAdam: its compression state once compressing, host memory (Note [Estimate for 1-bit Adam])."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.staging + self.master + self.hop_residual \
            + (self.onebit or 0)

    @property
    def on_host(self) -> int:
        """Offloaded bytes and OneBitAdam's compression state."""
        return self.host + (self.onebit or 0)

    def as_stats(self) -> dict:
        """The memory_stats() keys."""
        stats = {"params": self.params, "master": self.master, "grads": self.grads,
                 "optimizer_state": self.optimizer_state, "staging": self.staging, "hop_residual": self.hop_residual,
                 "offloaded": self.host, "on_device": self.total - self.on_host}
        if self.onebit is not None:
            stats["onebit"] = self.onebit
        return stats


Shapes = Sequence[tuple[str, tuple[int, ...]]]


def _shard_in_memory(layout, page_numel: int) -> int:
    """Elements of a stage-3 shard as the store holds it: in shared memory on the CPU, with the chunks of the
    buckets it maps on page boundaries (layout.place_chunks)."""
    return place_chunks(layout.buckets, page_numel)[1] if page_numel else layout.shard_numel()


def estimate(shapes: Shapes, cfg: EstimateConfig, frozen: Shapes = ()) -> MemoryEstimate:
    """Memory per rank for trainable parameters `shapes` (one param group) under `cfg`; `frozen`: the frozen
    parameters (frozen_shapes), which stage 3 shards too (Note [Frozen parameters at stage 3] in
    zero3/store.py) and stages 1-2 leave whole in the model (not counted: not the optimizer's)."""
    total = sum(math.prod(s) for _, s in shapes)
    if total == 0:
        raise ValueError("the model has no trainable parameters")
    rbs = cfg.reduce_bucket_size or auto_bucket_size(total, cfg.stage, across_nodes=cfg.node_aware)
    # With hybrid sharding a copy is sharded over `shards` ranks: state per rank is 1/shards.
    shards = cfg.shards or cfg.world_size
    replicas = cfg.world_size // shards
    nodes, in_flight = 1, 0
    if cfg.node_aware:  # flat over the world, node by node (Note [Node-aware chunk order] in layout.py)
        nodes, shards, replicas = replicas, cfg.world_size, 1
    pbytes = torch.empty((), dtype=cfg.param_dtype).element_size()
    # Stage 3 on the CPU: big buckets padded to whole pages per chunk, the shard's chunks of them on page
    # boundaries (Note [Stage-3 buckets mapped, not copied] in zero3/shared_shard.py), as the store plans them.
    page_numel = stage3_page_numel(shards, nodes, replicas, cfg.device, pbytes) if cfg.stage == 3 else 0
    layout = plan_layout([list(shapes)], shards, rbs, cfg.allgather_bucket_size or rbs, replicas=replicas,
                         whole_params=cfg.stage == 3, nodes=nodes, page_numel=page_numel)
    shard = layout.shard_numel()
    # Rank 0 has the most state: later ranks' chunks hold the padding at the end of the region.
    pieces = [pc.numel for pc in layout.pieces(0) if pc.numel > 1]
    state = STATE_PER_ELEMENT[cfg.optimizer] * sum(pieces) * 4
    grads = shard * 4 + (layout.total_numel * pbytes if cfg.stage == 1 else 0)
    master_dtype = torch.float32 if cfg.param_dtype in (torch.bfloat16, torch.float16) else cfg.param_dtype
    reduce_dtype = cfg.reduce_dtype or master_dtype
    rbytes = torch.empty((), dtype=reduce_dtype).element_size()
    slots = min(cfg.num_staging_buffers, len(layout.buckets))
    biggest = max(b.numel for b in layout.buckets)
    staged = cfg.stage >= 2 or reduce_dtype != cfg.param_dtype
    direct = reduce_dtype == master_dtype and (cfg.offload != "cpu" or cfg.device == "cpu")
    staging = slots * ((biggest if staged else 0) + (0 if direct else biggest // shards)) * rbytes
    separate_master = cfg.param_dtype != master_dtype or cfg.offload == "cpu" or cfg.inter_node_param_dtype is not None
    master = shard * 4 if separate_master else 0
    host = master + shard * 4 + state if cfg.offload == "cpu" else 0
    residual = shard * 4 + shard // replicas * 4 if replicas > 1 and cfg.inter_node_dtype == "int8" else 0
    if nodes > 1:  # node chunks: R chunks each (the residual's, and those of buckets in flight)
        node_chunks = shard * nodes
        residual = node_chunks * 4 + shard * 4 if cfg.inter_node_dtype == "int8" else 0
        in_flight = slots * (biggest // cfg.shards) * rbytes
        staging += in_flight
    params, gathered = layout.total_numel * pbytes, 0
    if cfg.stage == 3:  # Note [Estimate for stage 3]
        gathered = min(layout.total_numel, cfg.live_buckets * biggest) * pbytes
        held = _shard_in_memory(plan_layout([list(frozen)], shards, layout.bucket_numel, layout.bucket_numel,
                                            whole_params=True, nodes=nodes, page_numel=page_numel),
                                page_numel) if frozen else 0  # as the store plans them
        params = (_shard_in_memory(layout, page_numel) + held) * pbytes + gathered
    onebit = _onebit.state_bytes(shard, shards, replicas) if cfg.optimizer == "onebit" else None
    return MemoryEstimate(params=params, gathered=gathered, grads=grads, optimizer_state=state,
                          staging=staging, master=master, host=host, hop_residual=residual, in_flight=in_flight,
                          onebit=onebit)


# Note [Estimate for 1-bit Adam]
# OneBitAdam's state besides Adam's (Note [1-bit Adam under ZeRO] in onebit.py), as its memory_stats()
# entry counts it once compressing, for a shard of n elements (padding included):
# the frozen denominator (n fp32); on a flat mesh of W ranks
# also every rank's sending-side residual (W n fp32), the server residual (n), every owner's denominator
# (W n) and the last step's W 1-bit messages; on a hybrid mesh of R replicas the residuals of n + n / R.
# Not counted (as activations are not): a flat mesh's compression-stage backward keeps whole local
# gradients (all P elements, in the model's dtype), and the step's temporaries, a few shard-sized tensors.
# The arithmetic is onebit.state_bytes, which also sizes the room's residual tensor.

def estimate_ddp(shapes: Shapes, param_dtype: torch.dtype = torch.float32, optimizer: str = "adamw") -> MemoryEstimate:
    """DDP + the same torch optimizer, for comparison: full parameters, gradients and state on every rank
    (plus fp32 master weights for bf16/fp16 parameters, as mixed-precision training keeps them)."""
    total = sum(math.prod(s) for _, s in shapes)
    pbytes = torch.empty((), dtype=param_dtype).element_size()
    master = total * 4 if param_dtype != torch.float32 else 0
    return MemoryEstimate(params=total * pbytes, grads=total * pbytes,
                          optimizer_state=STATE_PER_ELEMENT[optimizer] * total * 4, staging=0, master=master,
                          host=0)


def count_shapes(n: int, largest: int = 4096 * 4096) -> list[tuple[str, tuple[int, ...]]]:
    """A model known only by its parameter count, as tensors no larger than a 4096x4096 matrix (what a
    7B transformer's largest weights are): stage 3 gathers whole tensors, so one n-element tensor would be
    one bucket holding the whole model."""
    full, rest = divmod(n, largest)
    return [(f"params.{i}", (largest,)) for i in range(full)] + ([(f"params.{full}", (rest,))] if rest else [])


def trainable_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each trainable parameter, tied ones once, in registration order."""
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


def frozen_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each frozen floating-point parameter, tied ones once, in registration order."""
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()
            if not p.requires_grad and p.is_floating_point()]


def load_factory(spec: str) -> Callable[[], torch.nn.Module]:
    """`package.module:callable` -> the callable (it must build the model with no arguments)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected 'module:factory' (e.g. 'mypkg.models:build_model'), got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"cannot import module '{module}' of '{spec}': {e}. Run from the directory that "
                          "contains it, or add it to PYTHONPATH") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module '{module}' has no attribute '{attr}' (from '{spec}')")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"'{spec}' is not callable: it must be a function or class that builds the model")
    return obj


def meta_model(spec: str) -> torch.nn.Module:
    """Builds the model of `spec` on the meta device (shapes only, no memory)."""
    factory = load_factory(spec)
    with torch.device("meta"):
        try:
            model = factory()
        except Exception as e:
            raise RuntimeError(f"building the model with {spec}() failed ({type(e).__name__}: {e}); the factory "
                               "must build the model with no arguments (wrap it in a function that does)") from e
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"'{spec}' returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}" if n < 10 * 2**30 else f"{n / 2**30:.1f}"


def format_table(num_params: int, rows: Sequence[tuple[EstimateConfig, MemoryEstimate]],
                 ddp: MemoryEstimate | None = None) -> str:
    """A DeepSpeed-style table: one row per configuration, GiB per rank."""
    head = (f"Estimated memory per rank, GiB, for model states (parameters, gradients, optimizer state, "
            f"buffers) of a model with {num_params:,} trainable parameters. Activations not included.\n")
    cols = ("ws", "stage", "offload", "dtype", "params", "grads", "master", "opt state", "staging",
            "device", "host", "total")
    lines = [head, "  ".join(f"{c:>9}" for c in cols)]
    names = {v: k for k, v in DTYPES.items()}

    def line(label, cfg_cells, m):
        vals = [m.params, m.grads, m.master, m.optimizer_state, m.staging, m.total - m.on_host, m.on_host, m.total]
        lines.append("  ".join(f"{c:>9}" for c in cfg_cells) + "  " + "  ".join(f"{_gib(v):>9}" for v in vals)
                     + (f"  {label}" if label else ""))

    for cfg, m in rows:
        ws = cfg.world_size if cfg.shards in (None, cfg.world_size) else f"{cfg.world_size // cfg.shards}x{cfg.shards}"
        ws = f"{ws} node-aware" if cfg.node_aware else ws
        line("", (ws, cfg.stage, cfg.offload, names[cfg.param_dtype]), m)
    if ddp is not None:
        line("<- DDP + the same optimizer, any world size", ("any", "DDP", "none", ""), ddp)
    return "\n".join(lines)
