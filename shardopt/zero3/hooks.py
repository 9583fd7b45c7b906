"""Stage 3's hooks: where the model's modules and autograd call into the store's rounds and buckets."""
from __future__ import annotations

import weakref

import torch
from torch import nn

from shardopt import _ext
from shardopt.loads import masters_after_load, same_values_hook
from shardopt.zero3.schedule import plan_reuse_scopes


def install(store, wrapper_ref, module: nn.Module, optimizer, waits) -> list:
    """Every hook stage 3 needs on `module` (a ShardedDDP's, held weakly: Note [Hooks die with the wrapper]
    in ddp.py); returns their handles."""
    # Note [Stage 3's gradient hooks in C++] in csrc/comm/grad_hooks.h: no Python per parameter in backward.
    rounds_ref = weakref.ref(store.rounds)
    n = len(store.params)
    grad_hooks = _ext._C.GradHooks(list(store.params), store.engine, [], _ext._C.GradRoute.BEFORE_ACCUMULATION,
                                   _begin_backward_hook(wrapper_ref, rounds_ref))
    grad_hooks.count_buckets([list(bs) for bs in store.buckets.buckets_of_param[:n]], _bucket_done_hook(rounds_ref))
    store.rounds.grad_hooks = grad_hooks
    return [grad_hooks] + _module_hooks(module, store.rounds, store.buckets, optimizer, waits)


def _begin_backward_hook(wrapper_ref, rounds_ref):
    """The first gradient hook of a backward pass (once, with the GIL): what the pass does with gradients,
    and the backward round if no saved weight has begun it yet."""
    def begin() -> int:
        wrapper, rounds = wrapper_ref(), rounds_ref()
        if wrapper is None or rounds is None:
            return _ext._C.PASS_IGNORE
        if not rounds.in_pass():  # first: its end-of-backward callback runs before the wrapper's reductions end
            rounds.begin_backward()
        return wrapper._begin_backward()
    return begin


def _bucket_done_hook(rounds_ref):
    def done(b: int) -> None:
        rounds = rounds_ref()
        if rounds is not None:
            rounds.bucket_grads_done(b)
    return done


def _saved_tensor_hooks(rounds, buckets):
    """Autograd's pack and unpack of saved tensors: a view of a bucket is saved as where it lies, and asks
    for its bucket again when backward unpacks it (Note [Parameters between gathers] in buckets.py)."""
    def unpack(saved):
        if not isinstance(saved, tuple):
            return saved
        b, t = saved
        rounds.need((b,))
        return t
    return torch.autograd.graph.saved_tensors_hooks(buckets.pack, unpack)


# Note [Stage-3 hooks]
# At stage 3 the wrapped module's hooks carry out Note [Stage-3 schedule]: its root forward opens a forward
# round and autograd's saved-tensor hooks; each module that waits for buckets asks for them before its
# forward and reports after it; the root's forward end (even by an exception) closes the round. state_dict()
# and load_state_dict() on the wrapped module see whole parameters: a collective, so every rank calls them,
# as with FSDP's full state dict; the returned tensors are copies.
def _module_hooks(module: nn.Module, rounds, buckets, optimizer, waits) -> list:
    saved = []  # the saved-tensor hooks context of the forward in progress
    handles = []

    def begin(mod, args):
        rounds.begin_forward()
        ctx = _saved_tensor_hooks(rounds, buckets)
        ctx.__enter__()
        saved.append(ctx)

    def end(mod, args, out):
        if saved:
            saved.pop().__exit__(None, None, None)
        rounds.end_forward(torch.is_grad_enabled())
        if torch.is_grad_enabled() and rounds.grad_hooks is not None:
            rounds.grad_hooks.ensure()  # a user's first p.register_hook cleared the tensor's hooks: ours back
        optimizer._note_model_version()  # a compiled forward counts as an edit (Note [Weights edited in place])

    handles.append(module.register_forward_pre_hook(begin))
    handles.append(module.register_forward_hook(end, always_call=True))

    handles += _wait_hooks(module, rounds, buckets, waits, frozen_backward=True)
    whole = []  # the gathered() context of a state_dict / load_state_dict in progress
    handles += _state_dict_hooks(module, buckets, optimizer.full_params, whole)
    same, finer = [], {}

    def load_and_free(mod, incompatible):
        whole.pop().__exit__(None, None, None)  # this rank's chunks take the loaded values
        masters_after_load(optimizer, same, finer)  # and the masters, whole (Note [A load of the values held])

    handles.append(module.register_load_state_dict_pre_hook(same_values_hook(optimizer, same, finer)))  # after gather
    handles.append(module.register_load_state_dict_post_hook(load_and_free))
    return handles


def _wait_hooks(module: nn.Module, rounds, buckets, waits, frozen_backward: bool, before=None) -> list:
    """Each module that waits asks for its buckets before its forward and reports after it (Note [Stage-3
    hooks]); with `frozen_backward`, a module that waits for frozen buckets also frees them after its backward
    (Note [Frozen parameters at stage 3] in build.py). `before(module)`, if given, runs first."""
    def needer(wanted):
        if before is not None:
            def hook(mod, args):
                before(mod)
                rounds.need(wanted)
            return hook
        return lambda mod, args: rounds.need(wanted)

    def frozen_needer(wanted, frozen):  # Note [Frozen parameters at stage 3] in build.py
        def hook(mod, args, kwargs):
            rounds.need(wanted)
            if torch.is_grad_enabled():
                return rounds.after_backward(frozen, args, kwargs)
        return hook

    def reporter(wanted, scope):
        return lambda mod, args, out: rounds.forward_done(id(mod), wanted, scope)

    handles = []
    scopes = plan_reuse_scopes(module, waits, rounds.reuse_limit())  # Note [A module called again] in rounds.py
    for w, scope in zip(waits, scopes):
        frozen = tuple(b for b in w.buckets if b >= buckets.trainable)
        if frozen_backward and frozen and not w.covered:
            handles.append(w.module.register_forward_pre_hook(frozen_needer(w.buckets, frozen), with_kwargs=True))
        else:
            handles.append(w.module.register_forward_pre_hook(needer(w.buckets)))
        if not w.covered:  # its parent's return reports these buckets (prefetch.ForwardWait.covered)
            handles.append(w.module.register_forward_hook(reporter(w.buckets, scope)))
    return handles


def _state_dict_hooks(module: nn.Module, buckets, full_params, whole: list) -> list:
    """state_dict() and load_state_dict() on `module` see whole parameters (a collective); a load's post hook
    (the caller's) pops `whole` and exits it, so that this rank's chunks take the loaded values."""
    def gather(writeback: bool):
        def hook(mod, *args):
            # state_dict(keep_vars=True) asks for the parameters themselves (which tensors, not values).
            if not writeback and args[-1]:
                whole.append(None)
                return
            ctx = full_params(writeback=writeback)
            ctx.__enter__()
            whole.append(ctx)
        return hook

    def copy_and_free(mod, state_dict, prefix, local_metadata):
        ctx = whole.pop()
        if ctx is None:
            return
        for k, v in state_dict.items():
            if torch.is_tensor(v) and buckets.holds(v):
                state_dict[k] = v.clone()
        ctx.__exit__(None, None, None)

    return [module.register_state_dict_pre_hook(gather(writeback=False)),
            module.register_state_dict_post_hook(copy_and_free),
            module.register_load_state_dict_pre_hook(gather(writeback=True))]


# Note [Models sharded for inference] in inference.py: the hooks of a frozen model that only runs forwards.
def install_inference(store, module: nn.Module, waits) -> list:
    """Every hook a model sharded for inference needs (its forwards run without gradients, each a LOOK pass
    of the store's agreement); returns their handles, which hold `store`."""
    modes = []  # the no_grad() context of each forward in progress

    def begin(mod, args, kwargs):
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in torch.utils._pytree.tree_leaves((args, kwargs))):
            raise RuntimeError(
                f"{type(mod).__name__} is sharded for inference (shardopt.shard_for_inference): its forwards run "
                "without gradients, and this one got an input that requires grad, whose gradient would silently "
                "be missing; pass inputs.detach() (or call it under torch.no_grad()), or train the model with "
                "ShardedOptimizer + ShardedDDP")
        ctx = torch.no_grad()
        ctx.__enter__()
        modes.append(ctx)
        store.rounds.begin_forward()

    def end(mod, args, out):
        try:
            store.rounds.end_forward(False)
        finally:
            if modes:
                modes.pop().__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(begin, with_kwargs=True),
               module.register_forward_hook(end, always_call=True)]
    def alone(mod):  # a submodule called on its own, outside the model's forward: no no_grad() of the root's
        if not store.rounds.in_pass() and torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(mod).__name__} is part of a model sharded for inference (shardopt.shard_for_inference) and "
                "was called on its own under grad mode: call it under torch.no_grad(), or call the whole model")

    handles += _wait_hooks(module, store.rounds, store.buckets, waits, frozen_backward=False, before=alone)
    whole = []

    def load_done(mod, incompatible):
        whole.pop().__exit__(None, None, None)  # this rank's chunks take the loaded values

    handles += _state_dict_hooks(module, store.buckets, store.gathered, whole)
    handles.append(module.register_load_state_dict_post_hook(load_done))
    return handles


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


def refuse_orphan(module: nn.Module) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError(_ORPHAN_MESSAGE)

    _ORPHANS[module] = [module.register_forward_pre_hook(refuse), module.register_state_dict_pre_hook(refuse)]


def forget_orphan(module: nn.Module) -> None:
    for h in _ORPHANS.pop(module, ()):
        h.remove()
