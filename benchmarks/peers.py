"""Every data-parallel trainer the step benchmark compares, behind one small interface.

A `Trainer` is three callables (forward, backward, step) around one copy of
the model, so the benchmark loop times every library the same way. Each
builder starts from the same seed, so every variant starts from the same
weights; `step` includes the library's zero_grad. AdamW(lr=1e-3,
weight_decay=0.1) everywhere, `fused=True` wherever the library lets us pass
torch's optimizer; the offload variants use their library's own CPU Adam.
Nothing clips gradients (DeepSpeed clips at 1.0 unless told
`gradient_clipping: 0`).

The shardopt hybrid variants (shard_group="node": sharded inside a node,
replicated across nodes, the gradient's inter-node hop exact, bf16 or int8)
read the node size from LOCAL_WORLD_SIZE, as FSDP2 HSDP does. What each
variant should send over a node's link is `expected_link_bytes` (Note [Link
bytes by arithmetic]).

Peers that are not installed, or fail to build, raise; the caller reports
the error in the table.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import torch

LR, WD = 1e-3, 0.1

# name -> builder kind. Order = table order.
VARIANTS = {
    "DDP + AdamW(fused)": "ddp",
    "torch ZeroRedundancyOptimizer": "torch-zero",
    "FSDP2 (fully_shard)": "fsdp2",
    "FSDP2 (fully_shard, reshard after forward: ZeRO-3)": "fsdp2-3",
    "FSDP2 HSDP (replicate across nodes, shard within)": "fsdp2-hsdp",
    "FSDP2 HSDP, reshard after forward (ZeRO-3 within the node)": "fsdp2-hsdp-3",
    "DeepSpeed ZeRO-2": "deepspeed",
    "DeepSpeed ZeRO-2 + CPU Adam offload": "deepspeed-offload",
    "DeepSpeed ZeRO-3": "deepspeed-3",
    "FairScale OSS + ShardedDDP": "fairscale",
    "FairScale, zero_grad(set_to_none=False)": "fairscale-keep",
    "shardopt ZeRO-1": "shardopt-1",
    "shardopt ZeRO-2": "shardopt-2",
    "shardopt ZeRO-2 + offload": "shardopt-2-offload",
    "shardopt ZeRO-2 + overlap_gather": "shardopt-2-gather",
    # One host: the gather after a step through the process group instead of shared memory (the default
    # there: Note [Gathering through shared memory] in shardopt/parallel/shared_memory.py).
    "shardopt ZeRO-2, gather through the process group": "shardopt-2-pg",
    "shardopt ZeRO-1, gather through the process group": "shardopt-1-pg",
    "shardopt ZeRO-3": "shardopt-3",
    # Stage 3 across nodes: node-aware by default (shardopt-3 above: the gradient phase and both parameter
    # gathers in two levels); these name the choices.
    "shardopt ZeRO-3, flat collectives (node_aware=False)": "shardopt-3-flat",
    "shardopt ZeRO-3 node-aware + bf16 inter-node phase": "shardopt-3-bf16",
    # ... and the parameter gathers across nodes rounded (Note [Stage 3's parameters across nodes, rounded]).
    "shardopt ZeRO-3 node-aware, gradients and parameters across nodes in bf16": "shardopt-3-bf16-bf16p",
    "shardopt ZeRO-3 node-aware, gradients in bf16, parameters in int8 across nodes": "shardopt-3-bf16-int8p",
    "shardopt ZeRO-3 node-aware, gradients and parameters across nodes in int8": "shardopt-3-int8-int8p",
    # Flat sharding when the ranks span nodes: node-aware collectives are on by default (shardopt-2 above);
    # these name the choices (Note [Two-level collectives] in shardopt/parallel/mesh_plan.py).
    "shardopt ZeRO-2, flat collectives (node_aware=False)": "shardopt-2-flat",
    "shardopt ZeRO-2 node-aware + bf16 inter-node phase": "shardopt-2-bf16",
    "shardopt ZeRO-2 node-aware + int8 inter-node phase": "shardopt-2-int8",
    # ... and the parameters across nodes in bf16 too (Note [Parameters across nodes in bf16]).
    "shardopt ZeRO-2 node-aware, gradients and parameters across nodes in bf16": "shardopt-2-bf16-bf16p",
    "shardopt ZeRO-2, 500k buckets": "shardopt-2-b500",
    "shardopt ZeRO-2, 1M buckets": "shardopt-2-b1000",
    "shardopt ZeRO-2, 2M buckets": "shardopt-2-b2000",
    "shardopt ZeRO-2 node-aware + bf16 inter-node phase, 500k buckets": "shardopt-2-bf16-b500",
    "shardopt ZeRO-2 node-aware + bf16 inter-node phase + overlap_gather": "shardopt-2-bf16-gather",
    "shardopt ZeRO-2 node-aware + bf16 inter-node phase + overlap_gather, 500k buckets": "shardopt-2-bf16-gather-b500",
    # Hybrid sharding (shard_group="node"): sharded inside a node, replicated across nodes.
    "shardopt hybrid (fp32 hop) + overlap_gather": "shardopt-hybrid-fp32-gather",
    "shardopt hybrid + bf16 hop + overlap_gather": "shardopt-hybrid-bf16-gather",
    "shardopt hybrid + int8 hop + overlap_gather": "shardopt-hybrid-int8-gather",
    # Stage 3 on the same mesh: parameters sharded and gathered inside the node (as HSDP).
    "shardopt ZeRO-3 hybrid (fp32 hop)": "shardopt-hybrid-fp32-s3",
    "shardopt ZeRO-3 hybrid + bf16 hop": "shardopt-hybrid-bf16-s3",
    # Smaller buckets start the slow link sooner in backward and leave a shorter tail after it
    # (benchmarks/results/2026-11-23-hybrid.md); -b500 = reduce_bucket_size 500k elements.
    "shardopt ZeRO-2 + overlap_gather, 500k buckets": "shardopt-2-gather-b500",
    "shardopt hybrid (fp32 hop) + overlap_gather, 500k buckets": "shardopt-hybrid-fp32-gather-b500",
    "shardopt hybrid + bf16 hop + overlap_gather, 500k buckets": "shardopt-hybrid-bf16-gather-b500",
    "shardopt hybrid + int8 hop + overlap_gather, 500k buckets": "shardopt-hybrid-int8-gather-b500",
    # ... with the gather inside the node through the process group instead of shared memory.
    "shardopt hybrid + bf16 hop + overlap_gather, 500k buckets, gather through the process group":
        "shardopt-hybrid-bf16-gather-b500-pg",
    "shardopt hybrid + int8 hop + overlap_gather, 500k buckets, gather through the process group":
        "shardopt-hybrid-int8-gather-b500-pg",
    # OneBitAdam (shardopt/onebit.py), compressing from step ONEBIT_FREEZE + 1: with the default turn
    # of 4 steps, the warm-up round (Note [Turns] in bench_step.py) is its exact-Adam warm-up.
    "shardopt hybrid + OneBitAdam + overlap_gather, 500k buckets": "shardopt-hybrid-onebit-gather-b500",
    "shardopt ZeRO-2 + OneBitAdam + overlap_gather, 500k buckets": "shardopt-2-onebit-gather-b500",
    "shardopt ZeRO-2 flat rings + OneBitAdam + overlap_gather, 500k buckets": "shardopt-2-onebit-flat-gather-b500",
    "shardopt ZeRO-3 hybrid + OneBitAdam, 500k buckets": "shardopt-hybrid-onebit-s3-b500",
}
ONEBIT_FREEZE = 4
# inter_node_dtype of the hybrid kinds.
HOP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8", "onebit": None}


@dataclasses.dataclass
class Trainer:
    forward: Callable
    backward: Callable
    step: Callable
    keep: tuple = ()
    """Objects that must stay alive (wrappers, engines)."""


def _model(cfg):
    from shardopt.tools.gpt import GPT

    torch.manual_seed(0)
    return GPT(cfg)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)


def _torch_style(wrapper, opt, set_to_none=True) -> Trainer:
    def step():
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return Trainer(wrapper, lambda loss: loss.backward(), step, (wrapper, opt))


def _deepspeed(model, bucket: int, batch: int, offload: bool, stage: int = 2) -> Trainer:
    import torch.distributed as dist

    # DeepSpeed asks for launcher variables even when the process group exists. LOCAL_RANK as torchrun
    # numbers it: hybrid sharding (shard_group="node") refuses one that disagrees with LOCAL_WORLD_SIZE.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % local))
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    config = {
        "train_micro_batch_size_per_gpu": batch, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                              "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
    }
    if stage == 3:  # its own keys: prefetch one bucket ahead, as shardopt's default
        z = config["zero_optimization"]
        del z["allgather_bucket_size"]
        z.update(stage3_prefetch_bucket_size=bucket, stage3_param_persistence_threshold=0)
    opt = None
    if offload:  # DeepSpeed requires its own CPU Adam with optimizer offload
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
    else:
        opt = _adamw(model.parameters())
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    return Trainer(engine, engine.backward, engine.step, (engine,))


def build(kind: str, cfg, bucket: int, batch: int) -> Trainer:
    """One variant on a fresh copy of the model (rank 0's weights, as every library broadcasts them)."""
    model = _model(cfg)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return _torch_style(DDP(model), _adamw(model.parameters()))
    if kind == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                      weight_decay=WD, fused=True)
        return _torch_style(DDP(model), opt)
    if kind in ("fsdp2", "fsdp2-hsdp", "fsdp2-3", "fsdp2-hsdp-3"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        if kind in ("fsdp2", "fsdp2-3"):
            mesh = init_device_mesh("cpu", (world,))
        else:  # HSDP: a 2D mesh, replicas across nodes, shards within one (torchrun's LOCAL_WORLD_SIZE)
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))
        reshard = kind.endswith("-3")  # ZeRO-3: parameters freed after forward, gathered again for backward
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return _torch_style(model, _adamw(model.parameters()))
    if kind in ("deepspeed", "deepspeed-offload", "deepspeed-3"):
        return _deepspeed(model, bucket, batch, offload=kind == "deepspeed-offload",
                          stage=3 if kind == "deepspeed-3" else 2)
    if kind in ("fairscale", "fairscale-keep"):
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim.oss import OSS

        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR, weight_decay=WD, fused=True)
        return _torch_style(ShardedDataParallel(model, opt), opt, set_to_none=kind == "fairscale")
    if kind.startswith("shardopt-"):
        import shardopt

        opt = shardopt.ShardedOptimizer(model.parameters(), **_shardopt_kwargs(kind))
        return _torch_style(shardopt.ShardedDDP(model, opt), opt)
    raise ValueError(f"unknown variant kind {kind!r}")


def _shardopt_kwargs(kind: str) -> dict:
    """ShardedOptimizer's arguments for a kind: shardopt-{1,2,3}[-gather|-offload|-flat|-pg|-bf16|-int8|-b500] or
    shardopt-hybrid-{fp32,bf16,int8}[-gather|-s3] (ZeRO-2, or ZeRO-3 with -s3, sharded inside a node,
    the gradient's inter-node hop in that format)."""
    import shardopt

    parts = kind.split("-")[1:]
    kw = dict(optim=torch.optim.AdamW, lr=LR, weight_decay=WD, fused=True, stage=2)
    if parts[0] == "hybrid":
        kw.update(shard_group="node", inter_node_dtype=HOP_DTYPES[parts[1]])
        if parts[1] == "onebit":  # its own 1-bit hop after the exact warm-up
            del kw["fused"]
            kw.update(optim=shardopt.OneBitAdam, freeze_step=ONEBIT_FREEZE)
        options = parts[2:]
    else:
        kw["stage"] = int(parts[0])
        options = parts[1:]
    for option in options:
        if option == "s3":  # stage 3: parameters too sharded inside the node
            kw["stage"] = 3
        elif option == "gather":  # the all-gather finishes during the next forward
            kw["overlap_gather"] = True
        elif option == "offload":  # the library's own fused CPU Adam over host master chunks
            del kw["fused"]
            kw.update(optim=shardopt.CPUAdam, adamw=True, offload="cpu")
        elif option == "onebit":  # OneBitAdam on a flat mesh
            del kw["fused"]
            kw.update(optim=shardopt.OneBitAdam, freeze_step=ONEBIT_FREEZE)
        elif option == "pg":  # one host: the parameter gather through the process group, not shared memory
            kw["shared_memory_gather"] = False
        elif option == "flat":  # node-aware collectives off: flat rings over every rank
            kw["node_aware"] = False
        elif option in ("bf16", "int8"):  # node-aware, its inter-node gradient phase compressed
            kw["inter_node_dtype"] = HOP_DTYPES[option]
        elif option == "bf16p":  # node-aware, its inter-node parameter phase in bf16
            kw["inter_node_param_dtype"] = torch.bfloat16
        elif option == "int8p":  # node-aware stage 3, its parameter gathers across nodes in block-scaled int8
            kw["inter_node_param_dtype"] = "int8"
        elif option.startswith("b") and option[1:].isdigit():  # -b500: reduce buckets of 500k elements
            kw["reduce_bucket_size"] = int(option[1:]) * 1000
        else:
            raise ValueError(f"unknown variant kind {kind!r}")
    return kw


# Note [Link bytes by arithmetic]
# What one node should send over its link per step, for S bytes of fp32
# gradients, W ranks numbered node by node, K per node, R = W / K nodes
# (shardopt/parallel/mesh_plan.py has the functions and the derivations):
# - DDP's ring all-reduce and flat ZeRO-1/2 (a ring reduce-scatter, then a ring
#   all-gather of the parameters): the ring crosses each node's link once per
#   direction, carrying 2 (W-1)/W S. It does not depend on K, and the DDP rows
#   of 2026-11-23-multinode.md measured it (25.5 MB for 17.0 MB at 2x2).
# - Flat ZeRO-3 with flat collectives (shardopt stage 3, node_aware=False, or on
#   one host): the reduce-scatter plus a parameter all-gather before forward and
#   another before backward, each (W-1)/W S: 3 (W-1)/W S, less the buckets
#   backward starts with, which are not gathered twice (Note [The seam between
#   forward and backward] in shardopt/zero3/rounds.py).
# - Hybrid (shardopt, FSDP2 HSDP): only the hop crosses, 2 (R-1)/R S per node
#   (every rank of a node all-reduces 1/K of it); the parameter all-gather stays
#   inside the node. bf16 hop: half; int8 hop: a quarter plus one fp32 scale per
#   256 elements. Stage 3 on the mesh (and HSDP with reshard after forward)
#   gathers parameters twice per step, but inside the node: the same bytes.
# - Flat ZeRO-1/2 with node-aware collectives (on by default when ranks span
#   nodes; Note [Two-level collectives] in mesh_plan.py): (R-1)/R S of gradient
#   in the inter-node phase's format, then (R-1)/R S of fp32 parameters:
#   2 (R-1)/R S exact, 1.5 (R-1)/R S with a bf16 gradient phase, (R-1)/R S with
#   both phases in bf16 (inter_node_param_dtype). Stage 3 (node-aware by
#   default too) gathers the parameters twice, each (R-1)/R S: 3 (R-1)/R S
#   exact (2.5 with a bf16 gradient phase), less the seam's buckets as above;
#   with its parameter gathers rounded across nodes (Note [Stage 3's parameters
#   across nodes, rounded]) each takes (R-1)/R S/2 in bf16 and (R-1)/R S/4
#   (1 + 4/256) in int8.
# - Others (torch ZeRO's broadcasts, FSDP2 flat and DeepSpeed over gloo, whose
#   reduce-scatter is an all-reduce): not derived here; the column stays empty.
def expected_link_bytes(kind: str, grad_bytes: int, world: int, per_node: int) -> float | None:
    """Note [Link bytes by arithmetic]: bytes one node sends per step, or None where not derived."""
    from shardopt.parallel.mesh_plan import MeshShape, hop_link_bytes, ring_link_bytes, two_level_link_bytes

    if kind.startswith("shardopt-2-onebit"):
        # Note [1-bit Adam under ZeRO]: 1-bit messages from each rank to every rank of the other nodes,
        # twice (the rows to their owners, then each owner's mean to every rank): 2 (W-K) K / W of the
        # gradient's elements per node at 1/8 byte + a scale per 1024; then the parameters' all-gather:
        # node-aware across nodes (the default), (R-1)/R S; with flat rings, (W-1)/W S.
        elements = grad_bytes / 4
        onebit = 2 * (world - per_node) * per_node / world * elements * (1 / 8 + 4 / 1024)
        if per_node < world and "flat" not in kind.split("-"):
            nodes = world // per_node
            return onebit + (nodes - 1) / nodes * grad_bytes
        return onebit + ring_link_bytes(world, per_node, grad_bytes) / 2
    parts = kind.split("-")
    flat_sharding = parts[0] == "shardopt" and parts[1] in ("1", "2", "3")
    gathers = 2 if flat_sharding and parts[1] == "3" else 1  # stage 3: before forward and before backward
    if flat_sharding and per_node < world and "flat" not in parts:  # node-aware (the default across nodes)
        kw = _shardopt_kwargs(kind)
        fmt = {None: None, torch.bfloat16: "bfloat16", "int8": "int8"}
        return two_level_link_bytes(world // per_node, grad_bytes, fmt[kw.get("inter_node_dtype")],
                                    fmt[kw.get("inter_node_param_dtype")], param_gathers=gathers)
    if flat_sharding and gathers == 2:  # a reduce-scatter and two all-gathers (forward, backward): 3 (W-1)/W S
        return 1.5 * ring_link_bytes(world, per_node, grad_bytes)
    if kind == "ddp" or (kind.startswith("shardopt-") and "hybrid" not in kind):
        return ring_link_bytes(world, per_node, grad_bytes)
    shape = MeshShape(world // per_node, per_node)
    if kind in ("fsdp2-hsdp", "fsdp2-hsdp-3"):
        return hop_link_bytes(shape, grad_bytes)
    if kind.startswith("shardopt-hybrid-"):
        fmt = "onebit" if kind.split("-")[2] == "onebit" else \
            {None: None, torch.bfloat16: "bfloat16", "int8": "int8"}[HOP_DTYPES[kind.split("-")[2]]]
        return hop_link_bytes(shape, grad_bytes, fmt)
    return None
