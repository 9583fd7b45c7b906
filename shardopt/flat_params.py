"""Stages 1-2's parameter store: every parameter a view into one flat buffer, whole on every rank.

The flat buffer holds the managed parameters in the layout's order (Note [Flat layout] in layout.py);
rank r steps its chunks of it and, after each step, every rank's chunks are gathered back into it by the
store's gatherer (Note [One gatherer] in parallel/gathers.py), now or during the next forward (Note
[Gathering in the next forward] in prefetch.py). Gradients reach the bucket engine through
C++ hooks (Note [Gradient hooks in C++] in csrc/comm/grad_hooks.h); stage 1 keeps them full-size in a
flat buffer of their own until the step, stage 2 only this rank's chunks.
"""
from __future__ import annotations

import operator
import time

import torch
import torch.distributed as dist

from shardopt import _ext
from shardopt.layout import Layout, plan_layout
from shardopt.loads import install_load_hooks
from shardopt.param_store import ParamStore
from shardopt.parallel.gathers import open_flat_gather


_DTYPE = operator.attrgetter("dtype")


class FlatStore(ParamStore):
    """The flat parameter buffer of stages 1-2 and the gathers that refill it (Note [One parameter store])."""

    waits_in_backward = True
    holds_whole = True

    @classmethod
    def plan(cls, names, world_size, config, sizes, replicas, nodes, params) -> Layout:
        return plan_layout(names, world_size, *sizes, replicas=replicas, nodes=nodes)

    def __init__(self, layout: Layout, rank: int, params: list, sharding, config, device, phase: dict):
        if params[0].is_meta:
            raise ValueError("the model is on the meta device: stage=3 builds it shard by shard (Note [Meta-device "
                             "models] in zero3/build.py); for stage 1/2 give it storage and values first: "
                             "model.to_empty(device=...), then the model's own initialisation, which also computes "
                             "buffers no checkpoint holds such as RoPE's inv_freq (a transformers model: "
                             "model.init_weights()), then load its weights; or shardopt.from_pretrained(...)")
        self.layout, self.rank, self.params, self.phase = layout, rank, params, phase
        self.dtype = params[0].dtype
        self.full_grads = config.keeps_full_grads
        # On one host every rank's buffer is in shared memory (Note [One gatherer] in parallel/gathers.py).
        self.flat_param, self.gather = open_flat_gather(layout, self.dtype, sharding, config, device)
        with torch.no_grad():
            for slot, p in zip(layout.params, params):
                view = self.flat_param[slot.offset:slot.end]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
        self.chunks = [self.flat_param[slice(*b.chunk(rank))] for b in layout.buckets]
        self.members, self.every_chunk = params, self.chunks  # frozen parameters stay whole at stages 1-2
        # Where each parameter must stay (Note [Parameters stay in the flat buffer] in optimizer.py).
        self._ptrs = [p.data_ptr() for p in params]
        # Stage 1: the params' .grad are views of one flat buffer; stage 2 keeps only this rank's chunks.
        self.flat_grad, self.resting_grads = None, [None] * len(params)
        if self.full_grads:
            self.flat_grad = torch.zeros_like(self.flat_param)
            for i, (slot, p) in enumerate(zip(layout.params, params)):
                p.grad = self.resting_grads[i] = self.flat_grad[slot.offset:slot.end].view(p.shape)
        self.engine = None  # set at attach (ShardedDDP builds it)
        self.grad_hooks = None  # the C++ gradient hooks of the wrapper attached now (install_hooks)
        self.gather_pending = False

    def attach(self, engine, waits) -> None:
        self.engine = engine
        self.gather.attach(engine)

    def broadcast(self, src: int, group) -> None:
        dist.broadcast(self.flat_param, src, group=group)

    def install_hooks(self, wrapper_ref, module, optimizer, waits) -> list:
        # Note [Gradient hooks in C++] in csrc/comm/grad_hooks.h: no Python per parameter.
        route = _ext._C.GradRoute.KEEP_IN_FLAT_BUFFER if self.full_grads else _ext._C.GradRoute.RELEASE
        self.grad_hooks = _ext._C.GradHooks(list(self.params), self.engine,
                                            self.resting_grads if self.full_grads else [], route,
                                            _begin_backward_hook(wrapper_ref))
        # With separate master weights (Note [Master weights] in master_step.py), new values loaded into the
        # model must reach the masters (Note [A load of the values held] in loads.py).
        return [self.grad_hooks] + install_load_hooks(module, optimizer)

    # --------------------------------------------------------------- gathers
    def publish(self, defer: bool) -> None:
        t0 = time.perf_counter()
        self.gather.start_all_gather_params(self.flat_param)
        self.gather_pending = self.gather.num_pending_gathers > 0
        self.phase["gather"] += time.perf_counter() - t0
        if not defer:
            self.wait()  # step() returns once no rank reads this one's chunks

    def wait(self) -> None:
        self._wait_gathers()
        t0 = time.perf_counter()
        self.gather.wait_readers()
        self.phase["gather"] += time.perf_counter() - t0

    def _wait_gathers(self) -> None:
        if self.gather_pending:
            t0 = time.perf_counter()
            self.gather.finish_all_gather_params()
            self.gather_pending = False
            self.phase["gather"] += time.perf_counter() - t0

    def wait_buckets(self, buckets) -> None:
        if self.gather_pending:
            t0 = time.perf_counter()
            for b in buckets:
                self.gather.finish_all_gather(b)
            self.gather_pending = self.gather.num_pending_gathers > 0
            self.phase["gather"] += time.perf_counter() - t0

    # ------------------------------------------------------------- questions
    def all_in_place(self) -> bool:
        # Every forward: C loops over the parameters (the usual case: nothing moved).
        return list(map(torch.Tensor.data_ptr, self.params)) == self._ptrs \
            and all(map(self.dtype.__eq__, map(_DTYPE, self.params)))

    def moved(self, index: int) -> bool:
        return self.params[index].data_ptr() != self._ptrs[index]

    def param_bytes(self) -> int:
        return self.flat_param.numel() * self.flat_param.element_size()


def _begin_backward_hook(wrapper_ref):
    """The C++ hooks' call into the wrapper, once per backward pass (Note [Hooks die with the wrapper] in
    ddp.py: held weakly)."""
    def hook() -> int:
        wrapper = wrapper_ref()
        return wrapper._begin_backward() if wrapper is not None else _ext._C.PASS_IGNORE
    return hook
