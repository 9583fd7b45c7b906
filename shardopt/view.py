"""The optimizer's view: what a ShardedOptimizer shows the code that reads or writes its state from outside.

Note [The optimizer's view]
---------------------------
checkpoint/ (shardopt's format, DeepSpeed's, torch.distributed.checkpoint), the integrations (Lightning,
the HF Trainer) and onebit.py need more of a ShardedOptimizer than torch.optim's interface gives: the
managed parameters in layout order, this rank's pieces and their inner-optimizer tensors, the layout and
the groups, and a few calls (wait for the gathers in flight, take the model's in-place edits before a
save, publish the parameters after a load). They used to read the optimizer's private members for that
(opt._params, opt._pieces, opt._piece_params, opt._take_model_edits(), opt._publish_params(), ...; and
optim_state.py set opt._consolidated on it), and checkpoint/ imported ShardedOptimizer and ShardedDDP to
check what it was given: rooms below the engine reaching up into it, so that no change inside the
optimizer could be made without reading them all.

So a ShardedOptimizer makes one OptimizerView in its constructor, `opt.view`, and those rooms use only
it. What it promises:
  - read-only names for what they read, forwarded live: what the optimizer sets later (the bucket engine,
    when ShardedDDP attaches) or changes in place (param_groups, the inner optimizer's state) reads
    through. The view copies nothing and holds no state of the optimizer's.
  - the few calls they make, each one of the optimizer's own paths (nothing new happens through it).
  - a home for the state a room keeps per optimizer (optim_state.py's consolidated state dict), instead
    of attributes it would set on the optimizer.
  - type checks without importing the engine: "x is a ShardedOptimizer" is
    `isinstance(getattr(x, "view", None), OptimizerView)`; ShardedDDP carries the marker base
    `ModelWrapper` of this module, so "m is a ShardedDDP" is `isinstance(m, ModelWrapper)`, with
    `m.module` the model it wraps and `m.optimizer` the ShardedOptimizer it feeds (both public).
The view is the one place outside optimizer.py that names the optimizer's private members: a change
there changes this file, and nothing below it. This module imports nothing of shardopt, so any room may
import it (tests/test_imports.py: no room below the engine imports ShardedOptimizer / ShardedDDP).
"""
from __future__ import annotations

import weakref


def _forward(name: str, doc: str) -> property:
    """A read-only property reading the optimizer's attribute `name` at each access."""
    return property(lambda self: getattr(self._opt, name), doc=doc)


class OptimizerView:
    """A ShardedOptimizer as checkpoint/, DCP, the integrations and onebit.py see it (Note above)."""

    __slots__ = ("_opt", "consolidated", "consolidated_to", "consolidation_hooked")

    def __init__(self, optimizer):
        self._opt = optimizer
        # checkpoint/optim_state.py's state (consolidate_state_dict, state_dict), kept here:
        self.consolidated: dict | None = None  # the whole torch.optim-format state on the rank it was
        #                                        consolidated to; None: not consolidated, or stale
        self.consolidated_to: int | None = None  # the rank the last consolidate_state_dict(to=...) named
        self.consolidation_hooked = False  # whether a step drops `consolidated` (hooked at the first one)

    # ------------------------------------------------------------- what it is
    params = _forward("_params", "The managed (trainable) parameters in layout order: params[j] is "
                      "layout.params[j] (at stage 3 an empty tensor between uses; its shape is the layout's).")
    layout = _forward("layout", "The flat layout (Note [Flat layout] in layout.py).")
    config = _forward("config", "The ShardConfig.")
    optim_class = _forward("optim_class", "The inner (elementwise torch) optimizer's class.")
    param_groups = _forward("param_groups", "The user's param groups (the same dicts as the optimizer's).")
    inner = _forward("inner", "The inner torch optimizer over this rank's pieces, or None (no piece here).")
    pieces = _forward("_pieces", "This rank's pieces (layout.Piece: param, bucket, start, end), in order.")
    piece_params = _forward("_piece_params", "Per piece, the tensor the inner optimizer steps (its master "
                            "values; the inner optimizer's state is keyed by it).")
    master_dtype = _forward("master_dtype", "The dtype of the master values (fp32 for a low-precision model).")
    master_device = _forward("master_device", "Where the master values live (the host with offload).")
    loss_scaler = _forward("loss_scaler", "The LossScaler, or None.")
    onebit = _forward("onebit", "OneBitAdam's OneBitStep (onebit.py), or None.")
    engine = _forward("engine", "The bucket engine, or None until a ShardedDDP attaches.")
    store = _forward("store", "The parameter store (param_store.ParamStore: members, local_parts, stream).")

    # ------------------------------------------------------------------ where
    sharding = _forward("sharding", "The resolved groups (Note [Hybrid sharding] in mesh_plan.py).")
    process_group = _forward("process_group", "The shard group: the layout is split over it.")
    world_group = _forward("world_group", "Every rank of the mesh (replicas too).")
    rank = _forward("rank", "This rank in the shard group.")
    world_size = _forward("world_size", "The shard group's size.")

    # --------------------------------------------------------------- questions
    @property
    def compressing(self) -> bool:
        """OneBitAdam past its warm-up: its room steps, and clips (Note [1-bit Adam under ZeRO])."""
        return self._opt._compressing()

    @property
    def attached(self) -> bool:
        """Whether a live ShardedDDP feeds this optimizer's gradients."""
        return self._opt.grads.attached

    # ------------------------------------------------------------------- calls
    def wait_params(self) -> None:
        """Returns once every parameter holds the last step's values (ShardedOptimizer.wait_params)."""
        self._opt.wait_params()

    def take_model_edits(self, saving: bool = False) -> None:
        """The masters take weights user code changed in place (Note [Weights edited in place] in
        optimizer.py); saving: for a checkpoint, compare the values whatever the change counts say."""
        self._opt._take_model_edits(saving=saving)

    def publish_params(self) -> None:
        """Every rank's master chunks into the model (a collective): after a load wrote the masters."""
        self._opt._publish_params()

    def load_master_from_model(self) -> None:
        """The master chunks take the model's values (after a load wrote the store's local parts)."""
        self._opt._load_master_from_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """ShardedOptimizer.zero_grad: gradients accumulated before a load belong to other weights."""
        self._opt.zero_grad(set_to_none)

    def finish_grads(self):
        """Gradients reduced (at stage 3 every backward round walked first); returns which parameters got a
        gradient on some rank (a collective: ShardedOptimizer.step's own path)."""
        return self._opt._grads_and_rounds()

    def after_every_step(self, fn) -> None:
        """fn(view) runs after each step() (a torch.optim step post-hook)."""
        self._opt.register_step_post_hook(lambda opt, args, kwargs: fn(opt.view))


class ModelWrapper:
    """Marker base of shardopt.ShardedDDP (Note [The optimizer's view]): `module` is the model it wraps,
    `optimizer` the ShardedOptimizer it feeds. Rooms below the engine ask isinstance(m, ModelWrapper)
    instead of importing ShardedDDP."""


_WRAPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def wrapped_by(module, wrapper) -> None:
    """ShardedDDP `wrapper` took `module`."""
    _WRAPPERS[module] = weakref.ref(wrapper)


def let_go(module, wrapper=None) -> None:
    """`wrapper` let go of `module` (detach()); None: a wrapper was dropped, so forget a dead entry only (a
    newer wrapper may have taken the module meanwhile)."""
    ref = _WRAPPERS.get(module)
    if ref is not None and ref() is wrapper:
        del _WRAPPERS[module]


def wrapper_of(model):
    """The live ShardedDDP of `model` (itself if it is one), or None: for calls that take either."""
    if isinstance(model, ModelWrapper):
        return model
    ref = _WRAPPERS.get(model) if model is not None else None
    return ref() if ref is not None else None


def view_of(optimizer) -> OptimizerView:
    """A ShardedOptimizer's view; a view is its own (for helpers called with either)."""
    return optimizer if isinstance(optimizer, OptimizerView) else optimizer.view
