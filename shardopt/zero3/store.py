"""Stage 3's parameter store: the ParamStore answers, composed of the stage-3 modules.

    gather.py (parallel/gathers.py)  how every rank's chunks of a bucket reach every rank (chosen once)
    buckets.py   a bucket's storage and states: allocate, gather, free
    rounds.py    walking the schedule pass by pass (schedule.py plans it, passes.py agrees on passes)
    build.py     values in: rank 0's, a meta-device model's own initialisation, frozen parameters
    whole.py     whole weights between passes: full_params, streaming, detach, persistent buckets
    hooks.py     where the model's modules and autograd call in
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardopt.layout import Layout, plan_layout, stage3_page_numel
from shardopt.param_store import ParamStore
from shardopt.parallel.gathers import open_bucket_gather
from shardopt.parallel.mesh import copy_group
from shardopt.parallel.shm_exchange import open_shm_exchange
from shardopt.prefetch import plan_forward_waits
from shardopt.tiers.disk import made_everywhere
from shardopt.tiers.param_shard import open_param_tier
from shardopt.zero3 import hooks, whole
from shardopt.zero3.buckets import Buckets
from shardopt.zero3.build import Builder
from shardopt.zero3.rounds import Rounds
from shardopt.zero3.schedule import plan_stage3_schedule


class ShardedStore(ParamStore):
    """This rank's chunks of the parameters and the buckets gathered now (stage 3; Note [One parameter
    store] in param_store.py)."""

    waits_in_backward = False  # Note [Stage 3 never waits in backward] in csrc/comm/bucket_engine.cpp
    holds_whole = False        # a parameter is an empty tensor between uses (Note [Parameters between gathers])

    @classmethod
    def plan(cls, names, world_size, config, sizes, replicas, nodes, params) -> Layout:
        """Buckets of whole parameters; those of at most param_persistence_threshold elements stay gathered
        (Note [Stage-3 buckets hold whole parameters] in layout.py)."""
        persistent = frozenset(i for i, p in enumerate(params) if p.numel() <= config.param_persistence_threshold)
        per_page = stage3_page_numel(world_size, nodes, replicas, params[0].device.type,
                                     params[0].element_size()) if params else 0
        return plan_layout(names, world_size, *sizes, replicas=replicas, whole_params=True, persistent=persistent,
                           nodes=nodes, page_numel=per_page)

    def __init__(self, layout: Layout, rank: int, params: list, sharding, config, device, phase: dict):
        self.rank, self.params, self.phase = rank, params, phase
        # No trainable parameter: a model sharded for inference, all of it frozen buckets (Note [Models sharded
        # for inference] in zero3/inference.py); the optimizer's shard is then empty.
        self.dtype = params[0].dtype if params else torch.get_default_dtype()
        self.flat_grad, self.resting_grads = None, [None] * len(params)  # gradients: only this rank's chunks
        self.engine = None
        group = sharding.shard
        self.tier = open_param_tier(config, device, dist.get_world_size(group))
        chunks = made_everywhere(lambda: self.tier.add(layout.buckets, self.dtype), sharding.world) \
            if self.tier is not None else None  # Note [The parameter shard on disk]
        self.gather = open_bucket_gather(layout, self.dtype, sharding, config, device, chunks)
        self.chunks = list(self.gather.chunks)
        self.buckets = Buckets(layout, rank, list(params), self.gather, self.dtype, device, phase, self.tier)
        # Which pass each rank starts next (Note [Passes every rank agrees on] in passes.py), on one host through
        # shared memory (Note [Agreements in shared memory] in parallel/shm_exchange.py).
        several = dist.get_world_size(group) > 1
        agree_group = copy_group(group, backend="gloo") if several else None
        self.rounds = Rounds(self.buckets, config, agree_group, open_shm_exchange(agree_group) if several else None)
        self.builder = Builder(self.buckets, sharding.world, agree_group, config.param_persistence_threshold)
        self.builder.shard_values(range(len(params)), layout.buckets)
        self.buckets.reset_peak()

    # What the optimizer and the rest of shardopt read (Note [One parameter store]).
    @property
    def layout(self) -> Layout:
        return self.buckets.layout

    @property
    def members(self) -> list:
        return self.buckets.members

    @property
    def every_chunk(self) -> list:
        return self.buckets.every_chunk

    @property
    def grad_hooks(self):
        return self.rounds.grad_hooks

    # ------------------------------------------------------------- life cycle
    def attach(self, engine, waits) -> None:
        self.engine = engine
        self.rounds.attach(plan_stage3_schedule(self.layout, waits))

    def adopt(self, module: torch.nn.Module, param_init_fn=None) -> bool:
        hooks.forget_orphan(module)  # a module whose last wrapper was dropped (Note [Orphaned stage-3 modules])
        self.builder.take_frozen(module)  # Note [Frozen parameters at stage 3] in build.py
        if not self.builder.on_meta:
            return False
        self.builder.materialize(module, param_init_fn)  # Note [Meta-device models] in build.py
        return True

    def forward_waits(self, module, index, layout) -> list:
        return plan_forward_waits(module, {id(p): i for i, p in enumerate(self.members)}, self.layout)

    def install_hooks(self, wrapper_ref, module, optimizer, waits) -> list:
        return hooks.install(self, wrapper_ref, module, optimizer, waits)

    def released(self, module: torch.nn.Module, orphaned: bool) -> None:
        if orphaned:
            hooks.refuse_orphan(module)

    def whole_copies(self) -> list:
        return whole.whole_copies(self.buckets, self.rounds.in_pass(), len(self.params))

    # ------------------------------------------------------------------ passes
    def begin_forward(self) -> None:
        self.rounds.begin_forward()

    def end_forward(self, grad_enabled: bool) -> None:
        self.rounds.end_forward(grad_enabled)

    def shadow_look(self) -> None:
        self.rounds.shadow_look()

    def catch_up(self) -> None:
        self.rounds.catch_up()

    def set_join_agreement(self, agree) -> None:
        """Under torch's Join the pass agreement is Join's (Note [Join] in shardopt/join.py); None: the store's."""
        self.rounds.join_agree = agree

    @property
    def backwards_owed(self) -> int:
        return self.rounds.backwards_owed

    def end_backward(self) -> None:
        self.rounds.end_backward()

    def settle(self) -> None:
        self.rounds.settle()

    def start_step(self) -> None:
        self.rounds.start_step()

    def forward_order(self) -> list[int]:
        """Buckets in the order the next forward needs them: the persistent ones (gathered at the step), then the
        schedule's forward."""
        layout = self.layout
        forward = list(self.rounds.schedule.forward) if self.rounds.schedule is not None else []
        return [b.index for b in layout.buckets if b.persistent] + forward

    def publish(self, defer: bool) -> None:
        whole.refresh_persistent(self.buckets, self.buckets.trainable)  # the next forward gathers the rest

    def wait(self) -> None:
        """Before this rank writes its shard (a step, a load): no peer still reads it."""
        self.buckets.wait_readers()

    # ------------------------------------------------------------- questions
    def moved(self, index: int) -> bool:
        return not self.buckets.in_place(self.params[index], index)

    def all_in_place(self) -> bool:
        return self.buckets.all_in_place(self.params)

    def resting_shape(self, index: int) -> tuple:
        slot = self.layout.params[index]
        whole_param = not slot.numel or self.layout.buckets[self.buckets.buckets_of_param[index][0]].persistent
        return tuple(slot.shape) if whole_param else (0,)

    def param_bytes(self) -> int:
        bk = self.buckets
        return self.gather.shard.numel() * self.gather.shard.element_size() + bk.frozen_shard_bytes + bk.live

    def holding(self, b: int, read: bool = True, write: bool = False):
        return self.buckets.holding(b, read, write)

    def local_parts(self, index: int):
        if self.tier is None:
            return super().local_parts(index)
        return self._held_parts(index)

    def _held_parts(self, index: int):
        """local_parts with the chunks on disk: each part valid (and written back) until the next is asked for."""
        slot = self.layout.params[index]
        for b in self.buckets.buckets_of_param[index]:
            cs, ce = self.layout.buckets[b].chunk(self.rank)
            s, e = max(cs, slot.offset), min(ce, slot.end)
            if s < e:
                with self.buckets.holding(b, read=True, write=True) as chunk:
                    yield s - slot.offset, e - slot.offset, chunk[s - cs:e - cs]

    def live_bytes(self) -> int:
        return self.buckets.live_bytes()

    @property
    def num_gathers(self) -> int:
        return self.buckets.num_gathers

    @property
    def peak_live(self) -> int:
        return self.buckets.peak_live

    def mapped_bytes(self) -> int:
        return self.buckets.mapped_bytes()

    def reset_peak(self) -> None:
        self.buckets.reset_peak()

    # ------------------------------------------------------ weights in and out
    def gathered(self, writeback: bool = True):
        return whole.gathered(self.buckets, self.rounds.in_pass(), writeback)

    def stream(self, indices):
        return whole.stream(self.buckets, self.rounds.in_pass(), indices)

    def after_load(self) -> None:
        # A frozen persistent bucket's chunks were written too.
        whole.refresh_persistent(self.buckets, len(self.buckets.full))
