"""Memory per rank of a ShardedOptimizer before building one: pure arithmetic on the real layout.

It plans the optimizer's own layout and counts model states only (as DeepSpeed's estimate_zero2_model_states_
mem_needs; activations and allocator slack come on top), under ShardedOptimizer.memory_stats()'s names:

    params           the flat parameter buffer with padding, model dtype (Note [Estimate for stage 3])
    grads            fp32 gradient chunks; stage 1: also the full flat gradient buffer (model dtype)
    optimizer_state  the inner optimizer's fp32 state over this rank's pieces (Adam: 2 per element)
    staging          min(num_staging_buffers, buckets) slots: a bucket (reduce dtype) when gradients are
                     copied (stage 2, a dtype change), a chunk when results cannot land in the gradient shard
    master           fp32 master chunks when they are not the parameters (bf16/fp16, offload="cpu")
    tier_buffers     the disk tiers' host buffers (Note [Estimate for the disk tiers])
    on_disk          bytes per kind of state in the disk tiers' files (not memory)
    offloaded        offload="cpu"/"nvme": master, gradient chunks, optimizer state and tier buffers, on the host
    onebit           OneBitAdam's compression state, on the host (Note [Estimate for 1-bit Adam])
    on_device        the rest
and, across nodes, `link`: the bytes one node sends per step (Note [Estimate of the link's bytes]).

Note [Estimate for mixed precision and offload]
-----------------------------------------------
As ShardedOptimizer allocates (Note [Master weights] in master_step.py, Note [Bucket engine] in
csrc/comm/bucket_engine.h); tests/test_estimate.py checks every case against memory_stats(). Not counted:
the output buffers the engine adds when gradients accumulate over several backwards without no_sync.

Note [Estimate for stage 3]
---------------------------
A rank keeps 1/N of the parameters and gathers a bucket only while it is used (Note [Stage-3 schedule] in
zero3/schedule.py): params counts the peak, `live_buckets` of the largest bucket (`opt.store.peak_live`;
memory_stats() sees what is gathered when called). fp32 Adam: 16P/N bytes (4 + 4 + 8 per element) plus
those and staging, as allocated up front (Note [Stage 3 never waits in backward] in csrc/comm/bucket_engine.cpp).

Note [Estimate of the link's bytes]
-----------------------------------
What one node sends over its link per step, from the padded layout's N elements, with R nodes (Note [Hybrid
sharding], Note [Two-level collectives], Note [Stage 3's parameters across nodes, rounded] in
parallel/mesh_plan.py; e the bytes of an element in a phase's format: the dtype's own, 2 for bf16, 1 + 4/256
for int8):
  hybrid (shards = a node's ranks)   2 (R-1)/R N e(inter_node_dtype): the hop; parameters stay in the node
  node-aware flat sharding          (R-1)/R N e(inter_node_dtype) for the gradients, then (R-1)/R N
                                     e(inter_node_param_dtype) per parameter gather: one at stages 1-2, two at
                                     stage 3 (an upper bound: the seam's buckets are gathered once)
One node, or flat rings across nodes: not estimated (None).

Note [Estimate for the disk tiers]
----------------------------------
As the tiers allocate (Note [Tiers] in tiers/__init__.py). offload="nvme": the master chunks, the inner
optimizer's state and the gradient shard leave memory for files (each bucket's record: its master chunk and a
chunk per kind of state, each padded to 4 KiB; the gradient shard whole); memory keeps the ring of
offload_buffer_count records (host). offload_param="nvme" (stage 3, a CPU model): the parameter shard, frozen
buckets' too, leaves memory for a file of 4 KiB-padded chunks; memory keeps the buckets gathered and a buffer
of the largest chunk for each chunk held at once (a gather holds its chunk until it arrives), at least
offload_buffer_count (Note [The parameter shard on disk] in tiers/param_shard.py). Chunks held at once are
counted as `live_buckets`; a model whose modules gather several buckets together holds more, at most one per
bucket, as memory_stats() reports. Which setting a memory limit needs: `fit` tries them from the fastest.
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
from shardopt.parallel.mesh_plan import bytes_per_element

# Optimizer state elements per parameter element (memory_stats() leaves out scalar step counters).
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
    shards: int | None = None  # hybrid: ranks per copy of the model (a node's); None: world_size (flat)
    node_aware: bool = False
    """With `shards` (ranks per node): node-aware flat sharding (Note [Two-level collectives]); an int8 phase
    keeps 1 + 1/nodes fp32 per 1/shards of the model, and a bucket in flight holds a node chunk."""
    inter_node_param_dtype: str | None = None
    """"bfloat16" or, at stage 3, "int8" (node_aware, fp32): stages 1-2 keep fp32 master chunks, 4 bytes per shard
    element (Note [Parameters across nodes in bf16] in parallel/mesh_plan.py); stage 3's shard is the master."""
    inter_node_dtype: str | None = None  # hybrid "int8": a residual of 1 + 1/replicas fp32 per shard element
    stage: int = 2
    live_buckets: int = 2  # stage 3: buckets gathered at once (the one in use and the prefetched one)
    offload: str = "none"
    param_dtype: torch.dtype = torch.float32
    optimizer: str = "adamw"  # a key of STATE_PER_ELEMENT
    reduce_bucket_size: int | None = None  # None: auto_bucket_size
    allgather_bucket_size: int | None = None  # no memory change; kept to rebuild the layout exactly
    num_staging_buffers: int = 2
    reduce_dtype: torch.dtype | None = None  # None: fp32, or the parameters' dtype if wider
    device: str = "cuda"  # the model's: offloaded from the CPU, gradients need no output buffer per slot
    offload_param: str = "none"  # stage 3: "nvme" keeps the parameter shard on disk (a CPU model)
    offload_buffer_count: int = 4  # the disk tiers' buffers (ShardConfig's)

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.shards is not None and (self.shards < 1 or self.world_size % self.shards):
            raise ValueError(f"shards must divide world_size ({self.world_size}), got {self.shards}")
        if self.node_aware and (self.shards is None or self.shards == self.world_size):
            raise ValueError("node_aware needs shards (ranks per node, --ranks-per-node) below world_size")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage}")
        if self.inter_node_param_dtype not in (None, "bfloat16", "int8"):
            raise ValueError(f"inter_node_param_dtype must be None, 'bfloat16' or 'int8', got "
                             f"{self.inter_node_param_dtype!r}")
        if self.inter_node_param_dtype is not None and (not self.node_aware or self.param_dtype != torch.float32):
            raise ValueError("inter_node_param_dtype needs node_aware and fp32 parameters (as ShardedOptimizer's)")
        if self.inter_node_param_dtype == "int8" and self.stage != 3:
            raise ValueError("inter_node_param_dtype='int8' is built for stage 3 (as ShardedOptimizer's)")
        if self.offload not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {self.offload!r}")
        if self.offload_param not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload_param must be 'none', 'cpu' or 'nvme', got {self.offload_param!r}")
        if self.offload_param != "none" and self.device != "cpu":
            raise ValueError(f"offload_param={self.offload_param!r} with a model on {self.device} is not built (as "
                             "ShardedOptimizer); use offload='cpu' or 'nvme' for the optimizer's state")
        if self.offload_param == "nvme" and (self.stage != 3 or self.offload == "none"):
            raise ValueError("offload_param='nvme' needs stage 3 and offload 'cpu' or 'nvme' (as ShardedOptimizer)")
        if self.offload_param == "nvme" and (self.shards or self.world_size) == 1:
            raise ValueError("offload_param='nvme' needs several ranks in the shard group (as ShardedOptimizer)")
        if self.offload_buffer_count < 1:
            raise ValueError(f"offload_buffer_count must be >= 1, got {self.offload_buffer_count}")
        if self.optimizer not in STATE_PER_ELEMENT:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; one of {', '.join(STATE_PER_ELEMENT)}")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds; keys as ShardedOptimizer.memory_stats()."""

    params: int
    grads: int
    optimizer_state: int
    staging: int
    master: int  # 0 when the parameters are the masters (fp32 without offload)
    host: int  # the bytes above that offload="cpu" puts on the host
    hop_residual: int = 0  # the int8 hop's error feedback
    gathered: int = 0  # stage 3: the part of `params` that is gathered buckets
    in_flight: int = 0  # node-aware: the part of `staging` in backward's node chunks (memory_stats misses it)
    onebit: int | None = None  # OneBitAdam's compression state, on the host (Note [Estimate for 1-bit Adam])
    tier_buffers: int = 0  # the disk tiers' host buffers (part of `host`)
    on_disk: dict = dataclasses.field(default_factory=dict)  # bytes per kind of state in the tiers' files
    link: float | None = None  # bytes one node sends per step (Note [Estimate of the link's bytes]); None: not known

    @property
    def total(self) -> int:
        """Bytes in memory (device and host)."""
        return self.params + self.grads + self.optimizer_state + self.staging + self.master + self.hop_residual \
            + (self.onebit or 0) + self.tier_buffers

    @property
    def on_host(self) -> int:
        """Offloaded bytes and OneBitAdam's compression state."""
        return self.host + (self.onebit or 0)

    @property
    def on_device(self) -> int:
        return self.total - self.on_host

    @property
    def disk(self) -> int:
        """Bytes in the disk tiers' files."""
        return sum(self.on_disk.values())

    def as_stats(self) -> dict:
        """The memory_stats() keys."""
        stats = {"params": self.params, "master": self.master, "grads": self.grads,
                 "optimizer_state": self.optimizer_state, "staging": self.staging, "hop_residual": self.hop_residual,
                 "tier_buffers": self.tier_buffers, "on_disk": dict(self.on_disk), "offloaded": self.host,
                 "on_device": self.on_device}
        if self.onebit is not None:
            stats["onebit"] = self.onebit
        return stats


Shapes = Sequence[tuple[str, tuple[int, ...]]]


def _shard_in_memory(layout, page_numel: int) -> int:
    """Elements of a stage-3 shard as the store holds it (layout.place_chunks)."""
    return place_chunks(layout.buckets, page_numel)[1] if page_numel else layout.shard_numel()


def estimate(shapes: Shapes, cfg: EstimateConfig, frozen: Shapes = ()) -> MemoryEstimate:
    """Memory per rank for trainable `shapes` (one param group) under `cfg`; `frozen` (frozen_shapes) counts at
    stage 3 only, which shards them (Note [Frozen parameters at stage 3] in zero3/build.py)."""
    total = sum(math.prod(s) for _, s in shapes)
    if total == 0:
        raise ValueError("the model has no trainable parameters")
    rbs = cfg.reduce_bucket_size or auto_bucket_size(total, cfg.stage, across_nodes=cfg.node_aware)
    shards = cfg.shards or cfg.world_size
    replicas = cfg.world_size // shards
    nodes, in_flight = 1, 0
    if cfg.node_aware:  # flat over the world, node by node (Note [Node-aware chunk order] in layout.py)
        nodes, shards, replicas = replicas, cfg.world_size, 1
    pbytes = torch.empty((), dtype=cfg.param_dtype).element_size()
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
    direct = reduce_dtype == master_dtype and (cfg.offload == "none" or cfg.device == "cpu")
    staging = slots * ((biggest if staged else 0) + (0 if direct else biggest // shards)) * rbytes
    separate_master = cfg.param_dtype != master_dtype or cfg.offload == "cpu" \
        or (cfg.inter_node_param_dtype is not None and cfg.stage != 3)
    master = shard * 4 if separate_master else 0
    host = master + shard * 4 + state if cfg.offload == "cpu" else 0
    on_disk, buffers = {}, 0
    if cfg.offload == "nvme":  # Note [Estimate for the disk tiers]
        on_disk, buffers = _state_tier(layout, STATE_PER_ELEMENT[cfg.optimizer], shard, cfg.offload_buffer_count)
        grads -= shard * 4
        master = state = 0
        host = buffers
    residual = shard * 4 + shard // replicas * 4 if replicas > 1 and cfg.inter_node_dtype == "int8" else 0
    if nodes > 1:  # node chunks: R chunks each (the residual's, and those of buckets in flight)
        node_chunks = shard * nodes
        residual = node_chunks * 4 + shard * 4 if cfg.inter_node_dtype == "int8" else 0
        in_flight = slots * (biggest // cfg.shards) * rbytes
        staging += in_flight
    params, gathered = layout.total_numel * pbytes, 0
    if cfg.stage == 3:  # Note [Estimate for stage 3]
        gathered = min(layout.total_numel, cfg.live_buckets * biggest) * pbytes
        frozen_layout = plan_layout([list(frozen)], shards, layout.bucket_numel, layout.bucket_numel,
                                    whole_params=True, nodes=nodes, page_numel=page_numel) if frozen else None
        held = _shard_in_memory(frozen_layout, page_numel) if frozen else 0  # as the store plans them
        params = (_shard_in_memory(layout, page_numel) + held) * pbytes + gathered
        if cfg.offload_param == "nvme":
            chunks = [_page(b.chunk_numel * pbytes)
                      for b in list(layout.buckets) + (list(frozen_layout.buckets) if frozen else [])]
            on_disk = dict(on_disk, params=sum(chunks))
            params = gathered
            held = max(cfg.offload_buffer_count, min(cfg.live_buckets, len(chunks))) * max(chunks)
            buffers += held
            host = buffers if cfg.offload == "nvme" else host + held
    onebit = _onebit.state_bytes(shard, shards, replicas) if cfg.optimizer == "onebit" else None
    return MemoryEstimate(params=params, gathered=gathered, grads=grads, optimizer_state=state,
                          staging=staging, master=master, host=host, hop_residual=residual, in_flight=in_flight,
                          onebit=onebit, tier_buffers=buffers, on_disk=on_disk,
                          link=link_bytes(cfg, layout.total_numel, nodes, replicas, rbytes, pbytes))


def link_bytes(cfg: EstimateConfig, numel: int, nodes: int, replicas: int, rbytes: int, pbytes: int) -> float | None:
    """Note [Estimate of the link's bytes]: one node's bytes per step for a layout of `numel` elements."""
    if nodes > 1:
        share = (nodes - 1) / nodes * numel
        gathers = 2 if cfg.stage == 3 else 1
        return share * (bytes_per_element(cfg.inter_node_dtype, rbytes)
                        + gathers * bytes_per_element(cfg.inter_node_param_dtype, pbytes))
    if replicas > 1:
        return 2 * (replicas - 1) / replicas * numel * bytes_per_element(cfg.inter_node_dtype, rbytes)
    return None


def _page(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def _state_tier(layout, kinds: int, shard: int, count: int) -> tuple[dict, int]:
    """offload="nvme": (bytes on disk per kind of state, the ring's host bytes) (Note [Estimate for the disk
    tiers]); fp32 masters and state."""
    parts = [_page(b.chunk_numel * 4) for b in layout.buckets]
    disk = {"master": sum(parts), "optimizer_state": kinds * sum(parts), "grads": _page(max(shard * 4, 1))}
    return disk, count * (1 + kinds) * max(parts)


# The tier settings `fit` tries, fastest first: the step in memory, then the optimizer's state on the host, the
# parameter shard on disk (stage 3, a CPU model), the optimizer's state on disk, both on disk.
TIERS = (("none", "none"), ("cpu", "none"), ("cpu", "nvme"), ("nvme", "none"), ("nvme", "nvme"))


def tier_choices(cfg: EstimateConfig) -> list[EstimateConfig]:
    """`cfg` under each setting of TIERS that ShardedOptimizer builds for it (offload_param: stage 3, a CPU
    model, several ranks)."""
    out = []
    for offload, params in TIERS:
        if params == "nvme" and (cfg.stage != 3 or cfg.device != "cpu" or (cfg.shards or cfg.world_size) == 1):
            continue
        out.append(dataclasses.replace(cfg, offload=offload, offload_param=params))
    return out


def fits(m: MemoryEstimate, cfg: EstimateConfig, memory: int, host_memory: int | None = None) -> bool:
    """Whether a rank holding `m` fits `memory` bytes: a CPU model's device is the host, so everything in memory
    counts; a GPU model's device bytes count, and its host bytes against `host_memory` when given."""
    if cfg.device == "cpu":
        return m.total <= memory
    return m.on_device <= memory and (host_memory is None or m.on_host <= host_memory)


def fit(shapes: Shapes, cfg: EstimateConfig, memory: int, host_memory: int | None = None,
        frozen: Shapes = ()) -> tuple[list[tuple[EstimateConfig, MemoryEstimate, bool]], EstimateConfig | None]:
    """Each tier setting for `cfg` (tier_choices) with its estimate and whether it fits; and the fastest that
    fits (None: none does). Model states only: activations come on top."""
    rows = [(c, m, fits(m, c, memory, host_memory)) for c in tier_choices(cfg)
            for m in (estimate(shapes, c, frozen),)]
    return rows, next((c for c, _, ok in rows if ok), None)


def describe_fit(cfg: EstimateConfig, rows, chosen: EstimateConfig | None, memory: int) -> str:
    """One line: which setting a memory limit needs at cfg's world size and stage, or that none fits."""
    where = f"{_fmt_ws(cfg)} ranks, stage {cfg.stage}: "
    if chosen is None:
        least = min(rows, key=lambda r: r[1].on_device if cfg.device != "cpu" else r[1].total)
        need = least[1].on_device if cfg.device != "cpu" else least[1].total
        return (where + f"nothing fits in {_gib(memory)} GiB per rank; the least is {_setting(least[0])} with "
                f"{_gib(need)} GiB (shard over more ranks, or use a higher stage)")
    m = next(m for c, m, _ in rows if c == chosen)
    held = (f"memory {_gib(m.total)}" if cfg.device == "cpu"  # a CPU model's device is the host
            else f"device {_gib(m.on_device)}, host {_gib(m.on_host)}")
    return where + f"{_setting(chosen)} fits in {_gib(memory)} GiB per rank: {held}, disk {_gib(m.disk)} GiB per rank"



def _setting(cfg: EstimateConfig) -> str:
    return f"offload={cfg.offload!r}" + (f", offload_param={cfg.offload_param!r}" if cfg.offload_param != "none" else "")


def _fmt_ws(cfg: EstimateConfig) -> str:
    ws = cfg.world_size if cfg.shards in (None, cfg.world_size) else f"{cfg.world_size // cfg.shards}x{cfg.shards}"
    return f"{ws} node-aware" if cfg.node_aware else str(ws)


# Note [Estimate for 1-bit Adam]
# OneBitAdam's state besides Adam's (Note [1-bit Adam under ZeRO] in onebit.py) once compressing, for a shard
# of n elements (onebit.state_bytes): the frozen denominator (n fp32); flat over W ranks also the worker
# residuals (W n), the server residual (n), every owner's denominator (W n) and the last W 1-bit messages;
# hybrid over R replicas the residuals of n + n / R. Not counted: a flat mesh's whole local gradients.


def estimate_ddp(shapes: Shapes, param_dtype: torch.dtype = torch.float32, optimizer: str = "adamw") -> MemoryEstimate:
    """DDP + the same torch optimizer, for comparison (fp32 masters for bf16/fp16 parameters)."""
    total = sum(math.prod(s) for _, s in shapes)
    pbytes = torch.empty((), dtype=param_dtype).element_size()
    master = total * 4 if param_dtype != torch.float32 else 0
    return MemoryEstimate(params=total * pbytes, grads=total * pbytes,
                          optimizer_state=STATE_PER_ELEMENT[optimizer] * total * 4, staging=0, master=master,
                          host=0)


def count_shapes(n: int, largest: int = 4096 * 4096) -> list[tuple[str, tuple[int, ...]]]:
    """A model of n parameters as tensors of at most a 4096x4096 matrix (a 7B transformer's largest): stage 3
    gathers whole tensors, so one n-element tensor would be a bucket holding the whole model."""
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
    """A DeepSpeed-style table: one row per configuration, GiB per rank; device, host and disk say what lives
    where, total what is in memory."""
    head = (f"Estimated memory per rank, GiB, for model states (parameters, gradients, optimizer state, "
            f"buffers) of a model with {num_params:,} trainable parameters. Activations not included.\n")
    cols = ("ws", "stage", "offload", "param", "dtype", "params", "grads", "master", "opt state", "staging",
            "tier bufs", "device", "host", "disk", "total")
    lines = [head, "  ".join(f"{c:>9}" for c in cols)]
    names = {v: k for k, v in DTYPES.items()}

    def line(label, cfg_cells, m):
        vals = [m.params, m.grads, m.master, m.optimizer_state, m.staging, m.tier_buffers, m.on_device, m.on_host,
                m.disk, m.total]
        link = f"  link {m.link / 1e6:,.1f} MB per node per step" if m.link is not None else ""
        lines.append("  ".join(f"{c:>9}" for c in cfg_cells) + "  " + "  ".join(f"{_gib(v):>9}" for v in vals)
                     + (f"  {label}" if label else "") + link)

    for cfg, m in rows:
        line("", (_fmt_ws(cfg), cfg.stage, cfg.offload, cfg.offload_param, names[cfg.param_dtype]), m)
    if ddp is not None:
        line("<- DDP + the same optimizer, any world size", ("any", "DDP", "none", "none", ""), ddp)
    return "\n".join(lines)
