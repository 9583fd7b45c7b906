"""A frozen model sharded for inference at stage 3: `shardopt.shard_for_inference(model)`.

    ref = shardopt.shard_for_inference(ref_model, param_persistence_threshold=..., reduce_bucket_size=...)
    with torch.no_grad():
        ref_logps = ref(**batch).logits.log_softmax(-1)     # every rank, as the policy's forward

Note [Models sharded for inference]
-----------------------------------
DPO keeps a frozen reference model beside the policy, distillation a teacher, RLHF a reward model: as big as
the trained model, never trained. Whole on every rank it costs the whole model once more per rank, which at
stage 3 is exactly what the run cannot afford. DeepSpeed shards it as a ZeRO-3 engine without an optimizer
(TRL's prepare_deepspeed: the reference model at stage 3, whole with stage 0 otherwise), FSDP by
fully_shard/FSDP without one (prepare_fsdp). Here it is the stage-3 store with no trainable parameter: a
ShardedStore whose optimizer layout is empty and whose every parameter is frozen, planned, sharded and gathered
as the trained model's frozen parameters already are (Note [Frozen parameters at stage 3] in store.py: one
region per dtype, whole parameters per bucket, the persistence threshold). So a rank holds its chunk of every
bucket (P/N of the model, in its dtype) and nothing else: no gradient, no master, no optimizer state, no
engine; a forward walks the same schedule (Note [Stage-3 schedule]), gathering bucket by bucket with the
same prefetch and max_live bounds and freeing each bucket once its modules have returned, so between
forwards only the persistent parameters are whole. Construction takes rank 0's values, one bucket at a
time, and each parameter gives its own storage back as its bucket is sharded: from then on no rank holds
the whole model.

What differs from a trained model is only what a frozen model never does:
  * Every forward runs without gradients (its root hook enters no_grad), so it is a LOOK pass of the
    store's agreement (Note [Passes every rank agrees on] in passes.py) and autograd saves nothing of it. A
    forward that gets an input requiring grad under grad mode is refused, naming the fix: its output would
    carry no gradient to that input, silently. (An input without grad, the reference model's case, gives
    the same outputs with or without grad mode: its parameters are frozen.)
  * Forwards of different counts per rank. The trained model's store reconciles them at the next pass
    every rank must run (a training forward or the step: the ranks with fewer walk the others' extra
    gathers there). A frozen model has no such pass of its own, so it has `sync()`: every rank calls it at
    the same point of its program (once per step, after an evaluation loop) and a rank that ran fewer
    forwards walks its peers' extra gathers there, as a trained rank does at its step (`Intent.SYNC`,
    the store's catch_up). Forwards of the same count on every rank (a reference model called once per
    micro-batch) need no sync. Every LOOK pass walks the whole schedule, so forwards of different inputs pair
    gather for gather; only the count must meet. With no sync() where counts differ, a rank with fewer
    forwards goes on to its next collective while its peer waits in a forward's agreement (the group's
    timeout ends it). The cost: the agreement's one exchange at a forward's start and one at its end (through
    shared memory on one host: Note [Agreements in shared memory]), as for any forward without gradients.
  * A submodule called on its own under grad mode (outside the model's forward, whose hook disables grad)
    is refused: autograd would save views of buckets that are freed after it.
  * state_dict() and load_state_dict() see whole parameters (a collective), as on a trained model; there are
    no masters to refresh after a load.
The API. `shard_for_inference(model, process_group=None, **options)` returns a `ShardedInference`, an
nn.Module that wraps `model` as DeepSpeed's inference engine or FSDP1 does (the caller replaces its reference
with it, as TRL does with the result of prepare_deepspeed; attributes it lacks are read from the model, as
DeepSpeed's engine and FSDP1 read them). The name says what it does in the words a DeepSpeed or FSDP user
looks for (deepspeed.init_inference, "shard"); it is a function, as FSDP2's fully_shard, because it changes
the model it is given: its parameters become empty tensors between uses. `options` are the stage-3 options
of ShardedOptimizer that a frozen model has a use for (INFERENCE_OPTIONS: bucket size, persistence threshold,
prefetch, max_live, collectives; `stage`, if given, must be 3), checked by ShardConfig as the optimizer's
are; training options are refused by name. The wrapper holds the store; the hooks on the model hold it too,
so the model keeps gathering while it lives even if the wrapper is dropped. Nothing of this is
ShardedOptimizer's (there is none): the store takes an empty optimizer layout, and its one addition is
catch_up().
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
    """The options of a trained model's stage-3 config that a model sharded beside it takes (ShardedTrainer's
    reference model: the same buckets, threshold, prefetch and collectives as the policy's)."""
    return {k: getattr(config, k) for k in INFERENCE_OPTIONS}


class ShardedInference(nn.Module):
    """A frozen model sharded at stage 3 for forwards without gradients (Note [Models sharded for inference]).
    Build it with shardopt.shard_for_inference(model, ...)."""

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
        """A collective every rank calls at the same point: a rank that ran fewer forwards than a peer walks the
        peer's extra gathers here (Note [Models sharded for inference])."""
        self._store.catch_up()

    def full_params(self) -> contextlib.AbstractContextManager:
        """Every parameter whole on this rank inside the block (a collective: every rank enters it); writes
        inside are dropped on exit."""
        return self._store.gathered(writeback=False)

    def memory_stats(self) -> dict:
        """Bytes of this model's parameters on this rank: `shard` (its chunks, always held), `gathered` (full
        buckets now: the persistent ones between forwards), `peak_gathered` (the most since construction), and
        `whole` (the model unsharded, for comparison)."""
        store = self._store
        return {"shard": store.frozen_shard_bytes, "gathered": store.live_bytes(), "peak_gathered": store.peak_live,
                "whole": sum(v.numel() * v.element_size() for v in store.views)}


def shard_for_inference(model: nn.Module, process_group=None, **options) -> ShardedInference:
    """Shards a frozen `model` over the ranks of `process_group` (the world by default) as stage 3 shards a
    trained one, for forwards without gradients only: a reference, teacher or reward model (Note [Models
    sharded for inference]). A collective: every rank calls it with the same model. Returns the model wrapped;
    its parameters are empty tensors between forwards from then on."""
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
