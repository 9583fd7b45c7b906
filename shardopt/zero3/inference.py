"""A frozen model sharded for inference at stage 3: `shardopt.shard_for_inference(model)`.

    ref = shardopt.shard_for_inference(ref_model, param_persistence_threshold=..., reduce_bucket_size=...)
    with torch.no_grad():
        ref_logps = ref(**batch).logits.log_softmax(-1)     # every rank, as the policy's forward

Note [Models sharded for inference]
-----------------------------------
A DPO reference model, a teacher or a reward model is as big as the trained model: whole on every rank it
costs what stage 3 saves. So it is the stage-3 store with an empty optimizer layout, every parameter frozen
(Note [Frozen parameters at stage 3] in build.py), every forward a LOOK pass without gradients (Note [Passes
every rank agrees on] in passes.py); grad mode where gradients would be lost, or saved views freed, is
refused. Ranks may run different numbers of forwards up to `sync()`, where the ones behind catch up.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from shardopt import device_ops as _device_ops
from shardopt.config import ShardConfig, auto_bucket_size
from shardopt.parallel.consistency import check_same_across_ranks
from shardopt.parallel.mesh import resolve_groups
from shardopt.view import wrapper_of
from shardopt.zero3 import hooks
from shardopt.zero3.store import ShardedStore

INFERENCE_OPTIONS = ("stage", "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
                     "max_live_parameters", "param_persistence_threshold", "comm_impl", "node_aware")
"""ShardedOptimizer's options that a model sharded for inference takes (Note [Models sharded for inference])."""


def inference_options(config: ShardConfig) -> dict:
    """The options of a trained model's stage-3 config that a model sharded beside it takes (a reference model)."""
    return {k: getattr(config, k) for k in INFERENCE_OPTIONS}


class ShardedInference(nn.Module):
    """A frozen model sharded at stage 3 (Note [Models sharded for inference]): shardopt.shard_for_inference."""

    def __init__(self, module: nn.Module, store: ShardedStore, handles: list):
        super().__init__()
        self.module = module
        self._store = store
        self._handles = handles

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # not set yet (a copy being built): no recursion
                raise
            return getattr(self.module, name)  # model.config, model.device, ... as DeepSpeed's engine reads them

    def sync(self) -> None:
        """A collective at the same point on every rank: a rank that ran fewer forwards walks its peers' extras."""
        self._store.catch_up()

    def full_params(self) -> contextlib.AbstractContextManager:
        """Every parameter whole on this rank inside the block (a collective); writes inside are dropped."""
        return self._store.gathered(writeback=False)

    def memory_stats(self) -> dict:
        """Parameter bytes on this rank: `shard`, `gathered` (now), `peak_gathered` and `whole` (unsharded)."""
        store = self._store
        return {"shard": store.buckets.frozen_shard_bytes, "gathered": store.live_bytes(), "peak_gathered": store.peak_live,
                "whole": sum(v.numel() * v.element_size() for v in store.buckets.views)}


def shard_for_inference(model: nn.Module, process_group=None, **options) -> ShardedInference:
    """Shards a frozen `model` over `process_group` for forwards without gradients (a collective; `options`:
    INFERENCE_OPTIONS)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_for_inference takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedInference) or getattr(model, "_shardopt_inference", False):
        raise ValueError("this model is sharded for inference already: use the ShardedInference you got")
    if wrapper_of(model) is not None:
        raise ValueError("this model is trained by a ShardedDDP: a model sharded for inference is a frozen one "
                         "of its own (a reference model is a copy of the policy, not the policy)")
    unknown = sorted(set(options) - set(INFERENCE_OPTIONS))
    if unknown:
        raise TypeError(f"shard_for_inference got {', '.join(unknown)}: options of training (gradients, optimizer "
                        f"state), which a model sharded for inference has none of; it takes "
                        f"{', '.join(INFERENCE_OPTIONS)}")
    if options.get("stage", 3) != 3:
        raise ValueError(f"shard_for_inference shards parameters, which is stage 3; got stage={options['stage']}. "
                         "At stages 1 and 2 parameters are whole on every rank: keep the frozen model as it is "
                         "(as TRL's prepare_deepspeed does below ZeRO-3)")
    named = list(model.named_parameters())
    trainable = [n for n, p in named if p.requires_grad]
    if trainable:
        raise ValueError(f"shard_for_inference: parameter '{trainable[0]}' requires grad ({len(trainable)} do): a "
                         "model sharded for inference is frozen; call model.requires_grad_(False) first (a reference "
                         "or teacher model), or train it with ShardedOptimizer + ShardedDDP")
    floats = [(n, p) for n, p in named if p.is_floating_point()]
    if not floats:
        raise ValueError("shard_for_inference: the model has no floating-point parameter to shard")
    if any(p.is_meta for _, p in named):
        raise ValueError("shard_for_inference: the model has parameters on the meta device (no values); load "
                         "its weights first (a reference model is the policy's initial weights)")
    devices = {p.device for _, p in floats}
    if len(devices) > 1:
        raise ValueError(f"shard_for_inference: the parameters are on {len(devices)} devices "
                         f"({', '.join(map(str, sorted(devices, key=str)))}): move the model to one first")
    device = _device_ops.materialization_device(floats[0][1].device)
    options = dict(options, stage=3)
    if options.get("reduce_bucket_size") is None:  # as ShardedOptimizer's default at stage 3 (about 16 buckets)
        options["reduce_bucket_size"] = auto_bucket_size(sum(p.numel() for _, p in floats), 3)
    config = ShardConfig(**options)
    sharding = resolve_groups(process_group, None, None, device.type, node_aware=config.node_aware)
    world = dist.get_world_size(sharding.shard)
    rbs = config.reduce_bucket_size
    layout = ShardedStore.plan([], world, config, (rbs, config.allgather_bucket_size or rbs), 1,
                               sharding.nodes.replicas if sharding.nodes is not None else 1, [])
    check_same_across_ranks(
        sharding.signature() + config.signature() + layout.signature()
        + [f"param {n} {list(p.shape)} {p.dtype}" for n, p in named]
        + [f"buffer {n} {list(b.shape)} {b.dtype}" for n, b in model.named_buffers()],
        "model sharded for inference", sharding.world)
    phase = dict.fromkeys(("reduce", "step", "publish", "gather"), 0.0)
    store = ShardedStore(layout, dist.get_rank(sharding.shard), [], sharding, config, device, phase)
    store.adopt(model)  # every frozen floating-point parameter, sharded bucket by bucket from rank 0's values
    if dist.get_world_size(sharding.world) > 1:  # buffers (and integer parameters) as rank 0 has them, as DDP
        src = dist.get_global_rank(sharding.world, 0)
        with torch.no_grad():
            for t in [p for _, p in named if not p.is_floating_point()] + list(model.buffers()):
                dist.broadcast(t.data, src, group=sharding.world)
    waits = store.forward_waits(model, {}, store.layout)
    store.attach(None, waits)
    handles = hooks.install_inference(store, model, waits)
    model._shardopt_inference = True
    return ShardedInference(model, store, handles)


__all__ = ["INFERENCE_OPTIONS", "ShardedInference", "inference_options", "shard_for_inference"]
