"""ShardedDDP: wraps a model so its gradients flow into a ShardedOptimizer (DDP semantics)."""
from __future__ import annotations

import contextlib
import operator
import types
import warnings
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
    """DDP for a model whose trainable parameters are all in `optimizer`. At stage 3 a meta-device model is
    materialised here, bucket by bucket, by each module's own initialisation or by `param_init_fn(module)` when
    given (Note [Meta-device models] in zero3/build.py)."""

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

        # Rank 0's initial values everywhere, like DDP: managed parameters through their store, the rest coalesced.
        self._group = group
        if dist.get_world_size(group) > 1:
            src = dist.get_global_rank(group, 0)
            store.broadcast(src, group)
            others = [p.data for _, p in named if id(p) not in optimizer._index]
            self._broadcast_coalesced(others + [b for b in module.buffers()])
            optimizer._load_master_from_model()

        this = weakref.ref(self)
        self._param_names = [named[pos][0] for pos in positions]
        handles = [module.register_forward_pre_hook(_check_in_place_hook(this))]
        # Note [Hooks die with the wrapper]; loads reach the masters (Note [A load of the values held] in loads.py).
        handles += store.install_hooks(this, module, optimizer, waits)
        _count_registrations()  # Note [Parameters fixed at wrap time]
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
        """Removes this wrapper's hooks and returns the module with its whole weights (stage 3: a collective)."""
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
        self.optimizer.wait_params()  # Note [Waiting in named_parameters]
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
        """Whether `params` is parameters() and no frozen one has a gradient: torch's clip is then opt's."""
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
        self._buffer_slots, self._buffer_list, seen = [], [], set()
        for mod in self.module.modules():
            for name, b in mod._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    self._buffer_slots.append((mod._buffers, name))
                    self._buffer_list.append(b)

    def _module_buffers(self) -> list:
        """self.module.buffers(), from the list of Note [Parameters fixed at wrap time]."""
        self._refresh_params()
        if not all(map(operator.is_, (d.get(k) for d, k in self._buffer_slots), self._buffer_list)):
            self._remember_buffers()
        return self._buffer_list

    # Note [Registrations under torch.compile]
    # Traced code skips the registration count: any module made in a step moves it, so a guard on it recompiles.
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
            # A backward that raised left buckets half launched: continuing would pair the wrong collectives.
            raise RuntimeError("the previous backward pass did not finish (did it raise?), so gradient "
                               "reduction is half done and ranks are out of step; restart training from "
                               "the last checkpoint")
        # DDP's rule: buffers are broadcast if the previous forward's backward reduced (once per accumulation).
        if self.optimizer.join.enabled():  # under torch's Join: the pass is agreed first (Note [Join])
            source = self.optimizer.join.before_forward(self)
            if source is not None:
                self._broadcast_coalesced(self._module_buffers(), source)
        elif self.broadcast_buffers and self._buffers_need_sync:
            self._broadcast_coalesced(self._module_buffers())
        out = self.module(*args, **kwargs)
        self._buffers_need_sync = torch.is_grad_enabled() and self._sync
        return out

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """DDP's `with model.join(): ...`, covering the optimizer too: the same as Join([model, opt])."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """The hook torch's Join runs on a rank out of inputs (Note [Join])."""
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
# Autograd holds gradient hooks in C++, out of the garbage collector's sight: holding the wrapper strongly they
# would keep a dropped model alive until exit. So they hold it weakly, and its collection removes them all.

# Note [Parameters fixed at wrap time]
# clip_grad_norm_(model.parameters()) runs every step: parameters() answers from a list taken at wrap time, taken
# again after any registration in the process or, for buffers, a slot replaced without one (model.to()).
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
# With overlap_gather, an EMA reading model.parameters() after step() would see values half gathered: it waits
# first, on the wrapper and the module (found in a weak registry, so that copy.deepcopy(model) waits for nothing).
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
    try:
        optimizer._detach_model()
    except RuntimeError as e:
        if not orphans[0]:
            raise  # detach() was called: its caller hears of it
        # Collected, or at exit: a peer that is gone cannot be waited for, and there is no caller to raise to.
        warnings.warn(f"shardopt: a ShardedDDP was released without waiting for its peers: {e}", RuntimeWarning)
    optimizer.store.released(module, orphaned=orphans[0])
