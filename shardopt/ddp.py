"""ShardedDDP: wraps a model so its gradients flow into a ShardedOptimizer (DDP semantics)."""
from __future__ import annotations

import contextlib
import operator
import types
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardopt import _ext
from shardopt.parallel.consistency import check_same_across_ranks
from shardopt.optimizer import ShardedOptimizer
from shardopt.prefetch import plan_forward_waits, plan_gather_order, plan_stage3_schedule


class ShardedDDP(nn.Module):
    """Data parallel wrapper for a model whose trainable parameters are all in `optimizer`.

    At construction: checks that every rank has the same parameters and buffers,
    broadcasts them from rank 0, and hooks every managed parameter so backward
    hands its gradient to the optimizer's bucket engine. `broadcast_buffers`
    re-broadcasts buffers from rank 0 before each forward, as DDP does.
    `no_sync()` accumulates gradients locally, as DDP's does. At stage 3 a model
    built on the meta device is materialised here, bucket by bucket, by each
    module's reset_parameters() or by `param_init_fn(module)` when given (Note
    [Meta-device models] in sharded_param.py).
    """

    def __init__(self, module: nn.Module, optimizer: ShardedOptimizer, broadcast_buffers: bool = True,
                 param_init_fn=None):
        super().__init__()
        if not isinstance(optimizer, ShardedOptimizer):
            raise TypeError(f"ShardedDDP needs a shardopt.ShardedOptimizer, got {type(optimizer).__name__}")
        _forget_orphan(module)  # a stage-3 module whose last wrapper was dropped (Note [Orphaned stage-3 modules])
        self.module = module
        self.optimizer = optimizer
        self.broadcast_buffers = broadcast_buffers
        self._sync = True
        self._callback_queued = False
        self._buffers_need_sync = True
        group = optimizer.world_group  # every rank of the mesh (Note [Hybrid sharding] in mesh_plan.py)

        named = list(module.named_parameters())
        positions = [None] * len(optimizer._params)
        for pos, (name, p) in enumerate(named):
            i = optimizer._index.get(id(p))
            if i is not None:
                positions[i] = pos
            elif p.requires_grad:
                raise ValueError(f"parameter '{name}' requires grad but is not in the ShardedOptimizer: build "
                                 "the optimizer from model.parameters(), or set requires_grad=False on it")
        missing = [i for i, pos in enumerate(positions) if pos is None]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameters (e.g. parameter {missing[0]}) are not "
                             "parameters of this model: wrap the model the optimizer was built from")
        stage3 = optimizer.param_shard is not None
        if stage3 and optimizer.param_shard.on_meta:
            optimizer.param_shard.materialize(module, param_init_fn)  # Note [Meta-device models]
            optimizer._load_master_from_model()

        def shape(p):  # at stage 3 a managed parameter is empty between uses: its shape is the layout's
            i = optimizer._index.get(id(p))
            return list(optimizer.layout.params[i].shape) if stage3 and i is not None else list(p.shape)

        check_same_across_ranks(
            [f"param {n} {shape(p)} {p.dtype} requires_grad={p.requires_grad}" for n, p in named]
            + [f"buffer {n} {list(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
            + [f"broadcast_buffers={broadcast_buffers}"],
            "model's parameters and buffers", group)
        waits = plan_forward_waits(module, optimizer._index, optimizer.layout)
        optimizer._attach(positions, list(plan_gather_order(optimizer.layout, waits)),
                          plan_stage3_schedule(optimizer.layout, waits) if stage3 else None)

        # Rank 0's initial values everywhere, like DDP: the flat buffer in one
        # collective, everything else (frozen params, buffers) coalesced.
        self._group = group
        if dist.get_world_size(group) > 1:
            src = dist.get_global_rank(group, 0)
            if not stage3:  # at stage 3 the optimizer took rank 0's values as it sharded them
                dist.broadcast(optimizer.flat_param, src, group=group)
            others = [p.data for _, p in named if id(p) not in optimizer._index]
            self._broadcast_coalesced(others + [b for b in module.buffers()])
            optimizer._load_master_from_model()

        # See Note [Hooks die with the wrapper].
        handles = []
        this = weakref.ref(self)
        if stage3:  # Python hooks: the parameter shards need Python per parameter anyway
            for i, p in enumerate(optimizer._params):
                handles.append(p.register_hook(_pre_accumulate_hook(this, i)))
                handles.append(p.register_post_accumulate_grad_hook(_grad_hook(this, i)))
        elif optimizer._params:
            # Note [Gradient hooks in C++] in csrc/comm/grad_hooks.h: no Python per parameter.
            stage = optimizer.config.stage
            self._grad_hooks = _ext._C.GradHooks(list(optimizer._params), optimizer.engine,
                                                 optimizer._grad_views if stage == 1 else [], stage,
                                                 _begin_backward_hook(this))
            handles.append(self._grad_hooks)
        # The parameter set is fixed here, as with DDP: parameters() answers from this list
        # (Note [Parameters fixed at wrap time]).
        _count_registrations()
        self._remember_params()
        # Parameters given new storage after wrapping are refused before any forward
        # (Note [Parameters stay in the flat buffer] in optimizer.py).
        self._param_names = [named[pos][0] for pos in positions]
        handles.append(module.register_forward_pre_hook(_check_in_place_hook(this)))
        if stage3:
            handles += _install_stage3_hooks(module, optimizer, waits)
        # With separate master weights (Note [Master weights] in master_step.py), new
        # values loaded into the model must reach the masters, or the next step
        # would overwrite them with the old ones. Post hooks run for every module
        # of a load, so this sees loads into the model or into this wrapper.
        if not stage3:  # stage 3: its own hooks (Note [Stage-3 hooks])
            same, finer = [], {}
            handles.append(module.register_load_state_dict_pre_hook(_same_values_hook(optimizer, same, finer)))
            handles.append(module.register_load_state_dict_post_hook(
                lambda mod, keys: _masters_after_load(optimizer, same, finer)))
        if optimizer.config.overlap_gather:
            handles += self._install_gather_waits(waits)
            _wait_in_named_parameters(module, optimizer)
        self._orphans = [stage3]  # cleared by detach(), which gives the module its whole weights
        self._finalizer = weakref.finalize(self, _detach, handles, optimizer, module, self._orphans)

    def detach(self) -> nn.Module:
        """Removes every hook this wrapper installed and returns the module, a plain nn.Module again with its
        whole weights (as DDP leaves a model after training).

        At stage 3 the parameters are gathered first (a collective: every rank calls it) and keep their
        values in tensors of their own; the rank holds the whole model from then on. The optimizer is done
        with this model: it refuses to step, and its full_params() no longer reaches the module.
        """
        opt = self.optimizer
        whole = None
        if opt.param_shard is not None:
            with opt.full_params(writeback=False), torch.no_grad():
                whole = [p.detach().clone() for p in opt._params]
        self._orphans[0] = False
        self._finalizer()
        if whole is not None:
            with torch.no_grad():
                for p, value in zip(opt._params, whole):
                    p.data = value
        return self.module

    def _install_gather_waits(self, waits) -> list:
        """Hooks that wait for parameters still being gathered (Note [Gathering in the next forward])."""
        opt = self.optimizer

        def waiter(buckets):
            return lambda *args: opt._wait_buckets(buckets)

        def wait_all(*args):
            opt.wait_params()

        handles = []
        for w in waits:
            handles.append(w.module.register_forward_pre_hook(waiter(w.buckets)))
            # Reading or loading weights through state dicts, from any module down.
            handles.append(w.module.register_state_dict_pre_hook(wait_all))
            handles.append(w.module.register_load_state_dict_pre_hook(wait_all))
        # Whatever runs after the forward (loss, backward, user code) sees final values.
        handles.append(self.module.register_forward_hook(wait_all))
        return handles

    def zero_grad(self, set_to_none: bool = True) -> None:
        """model.zero_grad() == opt.zero_grad(), as with DDP + torch.optim (and frozen parameters' grads)."""
        self.optimizer.zero_grad(set_to_none)
        for p in self._frozen_params():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # With overlap_gather, parameters read right after step() (an EMA) must be final.
        self.optimizer.wait_params()
        if recurse and remove_duplicate:
            self._refresh_params()
            return self._cached_named_parameters(prefix)  # Note [Parameters fixed at wrap time]
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True):
        if not recurse:
            return super().parameters(recurse)
        self.optimizer.wait_params()
        self._refresh_params()
        return iter(self._param_list)  # Note [Parameters fixed at wrap time]

    def is_every_gradient(self, params: list) -> bool:
        """Whether the gradients of `params` are exactly those the optimizer holds: `params` is this model's
        parameters() (the same tensors in the same order, as accelerate asks of an FSDP model) and no frozen
        one has a gradient. Then torch's clip_grad_norm_(params) and opt.clip_grad_norm() are the same clip."""
        self._refresh_params()
        mine = self._param_list
        return (len(params) == len(mine) and all(map(operator.is_, params, mine))
                and all(p.grad is None for p in self._frozen))

    def _cached_named_parameters(self, prefix: str):
        head = prefix + ("." if prefix else "")
        for name, p in self._named_params:
            yield head + name, p

    def _remember_params(self) -> None:
        managed = self.optimizer._index
        self._named_params = list(super().named_parameters())  # the wrapper's: "module." + the model's names
        self._param_list = [p for _, p in self._named_params]
        self._frozen = [p for _, p in self._named_params if id(p) not in managed]
        # Note [Norms summed in the model's order] in grad_sync.py
        self.optimizer.grads.order_norms_as([managed[id(p)] for p in self._param_list if id(p) in managed])
        self._remember_buffers()
        self._registrations_seen = _REGISTRATIONS[0]

    def _remember_buffers(self) -> None:
        """self.module.buffers() (each once, in its order), and where each sits: (its module's _buffers, name)."""
        self._buffer_slots, self._buffer_list, seen = [], [], set()
        for mod in self.module.modules():
            for name, b in mod._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    self._buffer_slots.append((mod._buffers, name))
                    self._buffer_list.append(b)

    def _module_buffers(self) -> list:
        """self.module.buffers() from the list taken at wrap time (Note [Parameters fixed at wrap time]), taken
        again when a registration happened or a buffer was replaced without one (model.to(), _buffers[k] = t)."""
        self._refresh_params()
        if not all(map(operator.is_, (d.get(k) for d, k in self._buffer_slots), self._buffer_list)):
            self._remember_buffers()
        return self._buffer_list

    # Note [Registrations under torch.compile]
    # The lists are taken again when a parameter, module or buffer was registered anywhere in the process
    # (_REGISTRATIONS): a count that any new module moves, nn.CrossEntropyLoss() made in a training step
    # included. Traced by torch.compile, the forward's buffer broadcast guarded on that count and was compiled
    # again at every such step (9 graphs in 10 steps at stage 2) until Dynamo's recompile limit left it
    # uncompiled. So traced code does not look at the count (Dynamo guards on the module's own parameter
    # and buffer dicts, and a replaced buffer is still seen); the eager paths (step, zero_grad,
    # named_parameters) still do, and refuse a parameter registered after wrapping.
    def _refresh_params(self) -> None:
        """Takes the list again if a parameter or module was registered anywhere since it was taken."""
        if torch.compiler.is_compiling():
            return  # Note [Registrations under torch.compile]
        if _REGISTRATIONS[0] != getattr(self, "_registrations_seen", None):
            self._remember_params()

    def _frozen_params(self):
        self._refresh_params()
        return self._frozen

    def _broadcast_coalesced(self, tensors):
        tensors = [t for t in tensors if t.numel()]
        if not tensors or dist.get_world_size(self._group) == 1:
            return
        src = dist.get_global_rank(self._group, 0)
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for ts in by_dtype.values():
                flat = _flatten_dense_tensors(ts)
                dist.broadcast(flat, src, group=self._group)
                for t, v in zip(ts, _unflatten_dense_tensors(flat, ts)):
                    t.copy_(v)

    def _on_grad(self, index: int, p: torch.Tensor) -> None:
        """A parameter's gradient is complete: hand it to the bucket engine."""
        opt = self.optimizer
        engine = opt.engine
        if opt.param_shard is not None:
            opt.param_shard.grad_ready(index)
        if not self._sync or opt._local_grads():  # OneBitAdam's flat compression stage: exchanged at step()
            engine.note_used(index)
            return
        if not self._callback_queued:
            # Runs once the whole backward pass is done: reduce what is left.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        opt.grads.on_grad(index, p)

    def _begin_backward(self) -> int:
        """The first gradient hook of a backward pass (Note [Gradient hooks in C++]): what the pass does."""
        opt = self.optimizer
        opt.grads.begin_backward()
        if not self._sync or opt._local_grads():  # OneBitAdam's flat compression stage: exchanged at step()
            return _ext._C.PASS_NOTE_USED
        if not self._callback_queued:
            # Runs once the whole backward pass is done: reduce what is left.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        return _ext._C.PASS_REDUCE

    def _end_backward(self) -> None:
        self._callback_queued = False
        self.optimizer._end_backward()

    def forward(self, *args, **kwargs):
        if self._callback_queued:
            # A backward pass started reducing and never finished (it raised). Its
            # buckets are half launched here and maybe complete on other ranks:
            # continuing would pair the wrong collectives.
            raise RuntimeError("the previous backward pass did not finish (did it raise?), so gradient "
                               "reduction is half done and ranks are out of step; restart training from "
                               "the last checkpoint")
        # Exactly DDP's rule: buffers are broadcast before a forward if the
        # previous forward was one whose backward reduces (grad enabled, not in
        # no_sync), so once per accumulation cycle, at its first micro-step.
        if self.broadcast_buffers and self._buffers_need_sync:
            self._broadcast_coalesced(self._module_buffers())
        out = self.module(*args, **kwargs)
        self._buffers_need_sync = torch.is_grad_enabled() and self._sync
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next one outside reduces them all."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old


# Note [Hooks die with the wrapper]
# A parameter's gradient hooks are held by autograd in C++, where Python's
# garbage collector cannot see them. A hook that referenced the wrapper or the
# optimizer strongly would close a cycle through C++ (parameter -> hook ->
# wrapper -> model -> parameter) that is never collected: a dropped model,
# its optimizer state and the process group would live until exit (a sweep
# that builds one model after another would keep them all). So the gradient
# hooks hold the wrapper weakly, and when the wrapper is collected
# every hook it installed is removed, as DDP's reducer removes its own: the
# model becomes a plain module again, and the optimizer refuses to step
# (nothing reduces gradients into it any more). At stages 1 and 2 the
# per-parameter hooks are C++ (Note [Gradient hooks in C++] in
# csrc/comm/grad_hooks.h): they hold the engine and the parameters, and reach
# the wrapper only through the weak `begin` hook (_begin_backward_hook), once
# per backward pass; the finalizer's remove() takes them off the gradient
# accumulators. Stage 3 keeps the Python hooks below.
def _grad_hook(wrapper_ref, index: int):
    def hook(p: torch.Tensor) -> None:
        wrapper = wrapper_ref()
        if wrapper is not None:
            wrapper._on_grad(index, p)
    return hook


def _pre_accumulate_hook(wrapper_ref, index: int):
    def hook(grad: torch.Tensor) -> None:
        wrapper = wrapper_ref()
        if wrapper is not None:
            wrapper.optimizer._before_accumulate(index)
    return hook


def _begin_backward_hook(wrapper_ref):
    def hook() -> int:
        wrapper = wrapper_ref()
        return wrapper._begin_backward() if wrapper is not None else _ext._C.PASS_IGNORE
    return hook


# Note [Parameters fixed at wrap time]
# clip_grad_norm_(model.parameters(), c) and model.zero_grad() run every step;
# walking a model of thousands of modules costs them milliseconds. As with
# DDP, the parameters are fixed when the model is wrapped (the optimizer and
# its flat buffer were built from them), so the wrapper answers parameters()
# and named_parameters() (recurse=True, remove_duplicate=True: what those
# idioms ask) from a list taken then, in the module's own order and names. A
# parameter or module registered after that anywhere in the process (any
# nn.Module's register_parameter / register_module / attribute assignment,
# counted by torch's global registration hooks) makes the next call walk the
# module again and take a new list, so an added parameter is always seen.
# The forward's buffer broadcast (DDP's broadcast_buffers) takes the buffers
# the same way, with buffer registrations counted too; each forward also checks
# that every listed buffer is still in its module's slot, as replacing one
# without a registration (model.to(), _apply, _buffers[name] = t) leaves it.
# Deleting one (del module.weight) registers nothing: a managed parameter
# stays the optimizer's anyway, and a frozen one deleted after wrapping stays
# listed until the next registration anywhere.
_REGISTRATIONS = [0]  # parameter and module registrations since import (any module)
_COUNTING = []


def _count_registrations() -> None:
    if _COUNTING:
        return

    def bump(*args):
        _REGISTRATIONS[0] += 1

    from torch.nn.modules import module as nn_module
    _COUNTING.append(nn_module.register_module_parameter_registration_hook(bump))
    _COUNTING.append(nn_module.register_module_module_registration_hook(bump))
    _COUNTING.append(nn_module.register_module_buffer_registration_hook(bump))


def _check_in_place_hook(wrapper_ref):
    @torch.compiler.disable
    def hook(module, args) -> None:
        wrapper = wrapper_ref()
        if wrapper is not None:
            wrapper.optimizer.check_params_in_place(wrapper._param_names)
    return hook


# Note [Waiting in named_parameters]
# With overlap_gather, step() returns while parameters are still being
# gathered, and the forward's hooks wait for them. Code that reads parameters
# right after step() through model.parameters() (an EMA, torch's
# AveragedModel, weight-norm logging) would read values half written. So, while
# a wrapper with overlap_gather lives, parameters()/named_parameters() wait
# first, on the wrapper (a method override) and on the wrapped module (an
# instance attribute, removed with the wrapper). The module finds its
# optimizer through a weak registry, not an attribute: copy.deepcopy(model)
# (as EMA code does) must give a plain module that waits for nothing.
_WAITING_MODULES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _waiting_named_parameters(module, *args, **kwargs):
    ref = _WAITING_MODULES.get(module)
    optimizer = ref() if ref is not None else None
    if optimizer is not None:
        optimizer.wait_params()
    return type(module).named_parameters(module, *args, **kwargs)


_waiting_named_parameters.__name__ = "named_parameters"  # pickles as getattr(module, "named_parameters")


def _wait_in_named_parameters(module: nn.Module, optimizer) -> None:
    _WAITING_MODULES[module] = weakref.ref(optimizer)
    module.named_parameters = types.MethodType(_waiting_named_parameters, module)


# Note [A load of the values held]
# --------------------------------
# With separate master weights (a bf16/fp16 model, offload: Note [Master weights] in master_step.py), a
# state dict loaded into the model is the new truth: the masters take the loaded values whole (at stage
# 3 as well), or the next step would publish the old ones over them. A load that changes no value is
# different: code that puts the model's own weights back (Lightning's WeightAveraging on resume, a
# checkpoint reloaded into the process that wrote it) would round a bf16 model's fp32 masters to bf16,
# where under DDP such a load changes nothing. So before a load, the values it brings are compared with
# the managed parameters' (in the model's dtype, as the load will write them; parameters it leaves out
# count as unchanged); if none differs, the masters keep their bits. One compare pass per load.
# A loaded value finer than the model's dtype (an fp32 checkpoint, pretrained weights, into a bf16 model)
# holds more than the model can: the masters take it at their own precision, not the model's rounding of
# it (which the load writes into the model), whether or not that rounding changed the model. So a bf16
# model wrapped first and loaded after starts from the file's fp32 values (a plain checkpoint loaded by the
# Lightning strategy too), as FSDP2's sharded fp32 parameters would; the model holds their rounding, as
# after any step.
def _same_values_hook(optimizer, same: list, finer: dict):
    def hook(mod, state_dict, prefix, *args):
        with torch.no_grad():
            values = [(p, state_dict.get(prefix + name)) for name, p in mod.named_parameters()
                      if id(p) in optimizer._index]
            same[:] = [all(_holds(p, value) for p, value in values)]
            finer.clear()
            finer.update((optimizer._index[id(p)], value) for p, value in values if _finer(value, p))
    return hook


def _holds(p: torch.Tensor, value) -> bool:
    if not torch.is_tensor(value):
        return value is None  # not in the state dict: the load leaves it
    return value.shape == p.shape and torch.equal(value.to(device=p.device, dtype=p.dtype), p.detach())


def _finer(value, p: torch.Tensor) -> bool:
    """Whether a loaded value carries more precision than the parameter's dtype (an fp32 value, a bf16 model)."""
    return torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape \
        and torch.finfo(value.dtype).eps < torch.finfo(p.dtype).eps


def _masters_after_load(optimizer, same: list, finer: dict) -> None:
    if same and same.pop():
        optimizer._note_model_version()  # the load wrote what was there: nothing to take
    else:
        optimizer._load_master_from_model()
    if finer:
        optimizer._load_master_from_values(finer)  # more than the model holds: at master precision
        finer.clear()


# Note [Stage-3 hooks]
# At stage 3 the wrapped module's hooks carry out Note [Stage-3 schedule]:
# its root forward opens a forward round and autograd's saved-tensor hooks
# (Note [Parameters between gathers]); each module that waits for buckets
# asks for them before its forward and reports after it; the root's forward
# end (even by an exception) closes the round. state_dict() and
# load_state_dict() on the wrapped module (or on this wrapper) see whole
# parameters: a collective, so every rank calls them, as with FSDP's full
# state dict; the returned tensors are copies.
def _install_stage3_hooks(module: nn.Module, optimizer, waits) -> list:
    shard = optimizer.param_shard
    saved = []  # the saved-tensor hooks context of the forward in progress
    handles = []

    def begin(mod, args):
        shard.begin_forward()
        ctx = torch.autograd.graph.saved_tensors_hooks(shard.pack, shard.unpack)
        ctx.__enter__()
        saved.append(ctx)

    def end(mod, args, out):
        if saved:
            saved.pop().__exit__(None, None, None)
        shard.end_forward(torch.is_grad_enabled())
        optimizer._note_model_version()  # a compiled forward counts as an edit (Note [Weights edited in place])

    handles.append(module.register_forward_pre_hook(begin))
    handles.append(module.register_forward_hook(end, always_call=True))

    def needer(buckets):
        return lambda mod, args: shard.need(buckets)

    def reporter(buckets):
        return lambda mod, args, out: shard.forward_done(id(mod), buckets)

    for w in waits:
        handles.append(w.module.register_forward_pre_hook(needer(w.buckets)))
        if not w.covered:  # its parent's return reports these buckets (prefetch.ForwardWait.covered)
            handles.append(w.module.register_forward_hook(reporter(w.buckets)))

    whole = []  # the gathered() context of a state_dict / load_state_dict in progress

    def gather(writeback: bool):
        def hook(mod, *args):
            # state_dict(keep_vars=True) asks for the parameters themselves (which tensors, not values).
            if not writeback and args[-1]:
                whole.append(None)
                return
            ctx = optimizer.full_params(writeback=writeback)
            ctx.__enter__()
            whole.append(ctx)
        return hook

    def copy_and_free(mod, state_dict, prefix, local_metadata):
        ctx = whole.pop()
        if ctx is None:
            return
        for k, v in state_dict.items():
            if torch.is_tensor(v) and shard.holds(v):
                state_dict[k] = v.clone()
        ctx.__exit__(None, None, None)

    same, finer = [], {}

    def load_and_free(mod, incompatible):
        whole.pop().__exit__(None, None, None)  # this rank's chunks take the loaded values
        _masters_after_load(optimizer, same, finer)  # and the masters, whole (Note [A load of the values held])

    handles.append(module.register_state_dict_pre_hook(gather(writeback=False)))
    handles.append(module.register_state_dict_post_hook(copy_and_free))
    handles.append(module.register_load_state_dict_pre_hook(gather(writeback=True)))
    handles.append(module.register_load_state_dict_pre_hook(_same_values_hook(optimizer, same, finer)))  # after gather
    handles.append(module.register_load_state_dict_post_hook(load_and_free))
    return handles


def _detach(handles, optimizer, module, orphans) -> None:
    for h in handles:
        h.remove()
    if _WAITING_MODULES.pop(module, None) is not None:
        module.__dict__.pop("named_parameters", None)
    optimizer._detach_model()
    if orphans[0]:
        _refuse_orphan(module)


# Note [Orphaned stage-3 modules]
# At stage 3 a managed parameter is an empty tensor between uses: its values
# live in the optimizer's shards and only a ShardedDDP's hooks gather them.
# detach() gathers them into the module for good. A wrapper that is simply
# dropped (garbage-collected) cannot: gathering is a collective, and a
# finalizer runs on each rank at a moment of its own. The module is then left
# with empty parameters, and its forward or state_dict() would fail obscurely
# or, worse, return empty tensors as if they were the weights. So such a module
# refuses both, saying what to do, until a new ShardedDDP (with the same
# optimizer, which still holds the shards) takes it again.
_ORPHANS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
_ORPHAN_MESSAGE = ("this module's parameters are sharded over the ranks (ZeRO stage 3) and the ShardedDDP that "
                   "gathered them was dropped without detach(), so here they are empty tensors. Wrap it again "
                   "with shardopt.ShardedDDP(module, optimizer) to go on training (or to save a checkpoint), or "
                   "call wrapper.detach() on every rank before dropping the wrapper to keep the whole weights")


def _refuse_orphan(module: nn.Module) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError(_ORPHAN_MESSAGE)

    _ORPHANS[module] = [module.register_forward_pre_hook(refuse), module.register_state_dict_pre_hook(refuse)]


def _forget_orphan(module: nn.Module) -> None:
    for h in _ORPHANS.pop(module, ()):
        h.remove()
