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
from torch.distributed.algorithms.join import Join, Joinable, _JoinConfig

from shardopt import _ext
from shardopt.parallel.consistency import check_same_across_ranks
from shardopt.optimizer import ShardedOptimizer
from shardopt.prefetch import plan_gather_order
from shardopt.view import ModelWrapper, let_go, wrapped_by
from shardopt.weights.stream import init_for_pending, load_pending, pending_weights


class ShardedDDP(nn.Module, ModelWrapper, Joinable):  # the marker lets checkpoint/ know it (Note [The optimizer's view])
    """Data parallel wrapper for a model whose trainable parameters are all in `optimizer`.

    At construction: checks that every rank has the same parameters and buffers,
    broadcasts them from rank 0, and hooks every managed parameter so backward
    hands its gradient to the optimizer's bucket engine. `broadcast_buffers`
    re-broadcasts buffers from rank 0 before each forward, as DDP does.
    `no_sync()` accumulates gradients locally, as DDP's does. At stage 3 a model
    built on the meta device is materialised here, bucket by bucket, by each
    module's reset_parameters() or by `param_init_fn(module)` when given (Note
    [Meta-device models] in zero3/store.py). What differs per stage is the
    optimizer's parameter store's (Note [One parameter store] in param_store.py).
    """

    def __init__(self, module: nn.Module, optimizer: ShardedOptimizer, broadcast_buffers: bool = True,
                 param_init_fn=None):
        super().__init__()
        if not isinstance(optimizer, ShardedOptimizer):
            raise TypeError(f"ShardedDDP needs a shardopt.ShardedOptimizer, got {type(optimizer).__name__}")
        store = optimizer.store
        self.module = module
        self.optimizer = optimizer
        self.broadcast_buffers = broadcast_buffers
        self._sync = True
        self._callback_queued = False
        self._buffers_need_sync = True
        self._join_config = _JoinConfig.construct_disabled_join_config()  # torch's Join (Note [Join] in join.py)
        group = optimizer.world_group  # every rank of the mesh (Note [Hybrid sharding] in mesh_plan.py)
        held = next((name for name, m in module.named_modules() if getattr(m, "_shardopt_inference", False)), None)
        if held is not None:  # its parameters are another store's (Note [Models sharded for inference])
            raise ValueError(f"submodule '{held or type(module).__name__}' is sharded for inference "
                             "(shardopt.shard_for_inference): its parameters are that store's, empty here. Keep "
                             "the frozen model beside the trained one (as TRL keeps ref_model) and wrap only the "
                             "trained model with ShardedDDP")

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

        def shape(p):  # a managed parameter's shape is the layout's (at stage 3 it is empty between uses)
            i = optimizer._index.get(id(p))
            return list(optimizer.layout.params[i].shape) if i is not None else list(p.shape)

        check_same_across_ranks(
            [f"param {n} {shape(p)} {p.dtype} requires_grad={p.requires_grad}" for n, p in named]
            + [f"buffer {n} {list(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
            + [f"broadcast_buffers={broadcast_buffers}"],
            "model's parameters and buffers", group)
        pending = pending_weights(module)
        if pending is not None and param_init_fn is None:
            param_init_fn = init_for_pending(module)  # the file gives the values (shardopt.from_pretrained)
        if store.adopt(module, param_init_fn):  # a meta-device model got its values (stage 3)
            optimizer._load_master_from_model()
        waits = store.forward_waits(module, optimizer._index, optimizer.layout)
        optimizer._attach(positions, list(plan_gather_order(optimizer.layout, waits)), waits)

        # Rank 0's initial values everywhere, like DDP: the managed parameters as their store holds them (the
        # flat buffer in one collective; stage 3 took rank 0's values as it sharded them), everything else
        # (frozen params, buffers) coalesced.
        self._group = group
        if dist.get_world_size(group) > 1:
            src = dist.get_global_rank(group, 0)
            store.broadcast(src, group)
            others = [p.data for _, p in named if id(p) not in optimizer._index]
            self._broadcast_coalesced(others + [b for b in module.buffers()])
            optimizer._load_master_from_model()

        # Parameters given new storage after wrapping are refused before any forward, before any other hook
        # of the forward runs (Note [Parameters stay in the flat buffer] in optimizer.py).
        this = weakref.ref(self)
        self._param_names = [named[pos][0] for pos in positions]
        handles = [module.register_forward_pre_hook(_check_in_place_hook(this))]
        # Gradient hooks, and whatever module and state-dict hooks the store needs (loads reach the masters:
        # Note [A load of the values held] in loads.py). See Note [Hooks die with the wrapper].
        handles += store.install_hooks(this, module, optimizer, waits)
        # The parameter set is fixed here, as with DDP: parameters() answers from this list
        # (Note [Parameters fixed at wrap time]).
        _count_registrations()
        self._remember_params()
        if optimizer.config.overlap_gather:
            handles += self._install_gather_waits(waits)
            _wait_in_named_parameters(module, optimizer)
        self._orphans = [True]  # cleared by detach(), which gives the module its whole weights
        wrapped_by(module, self)  # view.wrapper_of: load_weights / save_weights take the module too
        if pending is not None:
            load_pending(self, pending)  # a model shardopt.from_pretrained built: its weights, each rank its part
        self._finalizer = weakref.finalize(self, _detach, handles, optimizer, module, self._orphans)
        optimizer.join.attach(self)

    def detach(self) -> nn.Module:
        """Removes every hook this wrapper installed and returns the module, a plain nn.Module again with its
        whole weights (as DDP leaves a model after training).

        At stage 3 the parameters are gathered first (a collective: every rank calls it) and keep their
        values in tensors of their own; the rank holds the whole model from then on. The optimizer is done
        with this model: it refuses to step, and its full_params() no longer reaches the module.
        """
        whole = self.optimizer.store.whole_copies()
        self._orphans[0] = False
        let_go(self.module, self)
        self._finalizer()
        if whole is not None:
            with torch.no_grad():
                for p, value in zip(self.optimizer._params, whole):
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

    def _broadcast_coalesced(self, tensors, src: int | None = None):
        """`tensors` take global rank `src`'s values (rank 0 of the group by default)."""
        tensors = [t for t in tensors if t.numel()]
        if not tensors or dist.get_world_size(self._group) == 1:
            return
        if src is None:
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
        self.optimizer.join.backwards += 1  # Note [Join]: each training forward's backward reduces once
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
        if self.optimizer.join.enabled():  # under torch's Join: the pass is agreed first (Note [Join])
            source = self.optimizer.join.before_forward(self)
            if source is not None:
                self._broadcast_coalesced(self._module_buffers(), source)
        elif self.broadcast_buffers and self._buffers_need_sync:
            self._broadcast_coalesced(self._module_buffers())
        out = self.module(*args, **kwargs)
        self._buffers_need_sync = torch.is_grad_enabled() and self._sync
        return out

    # ------------------------------------------------ torch's Join (Note [Join] in join.py)
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """DDP's `with model.join(): ...`: ranks with fewer batches shadow the others until all are done.
        Covers the optimizer too (its shard is stepped on a joined rank); the same as Join([model, opt])."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """The hook torch's Join runs on a rank out of inputs: it shadows the others' forward, backward and
        step (its optimizer's part included; Note [Join])."""
        return self.optimizer.join.make_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.optimizer.device

    @property
    def join_process_group(self):
        return self.optimizer.world_group

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
# the wrapper only through the weak `begin` hook (flat_params._begin_backward_hook),
# once per backward pass; the finalizer's remove() takes them off the gradient
# accumulators. Stage 3 keeps Python hooks (zero3/hooks.py), as weak.

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


def _detach(handles, optimizer, module, orphans) -> None:
    for h in handles:
        h.remove()
    let_go(module)
    if _WAITING_MODULES.pop(module, None) is not None:
        module.__dict__.pop("named_parameters", None)
    optimizer._detach_model()
    optimizer.store.released(module, orphaned=orphans[0])
