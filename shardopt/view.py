"""The optimizer's view: what a ShardedOptimizer shows the code that reads or writes its state from outside.

Note [The optimizer's view]
---------------------------
checkpoint/, the integrations and onebit.py reach a ShardedOptimizer only through `opt.view` (names forwarded
live, the optimizer's own calls, per-optimizer state) and recognise it without importing the engine
(`isinstance(getattr(x, "view", None), OptimizerView)`, `ModelWrapper`). It imports nothing of shardopt.
"""
from __future__ import annotations

import weakref


def _forward(name: str, doc: str) -> property:
    return property(lambda self: getattr(self._opt, name), doc=doc)


class OptimizerView:
    """A ShardedOptimizer as checkpoint/, DCP, the integrations and onebit.py see it (Note above)."""

    __slots__ = ("_opt", "consolidated", "consolidated_to", "consolidation_hooked", "saver", "__weakref__")

    def __init__(self, optimizer):
        self._opt = optimizer
        # checkpoint/optim_state.py's state (consolidate_state_dict, state_dict), kept here:
        self.consolidated: dict | None = None  # the whole state on rank consolidated_to; None: none, or stale
        self.consolidated_to: int | None = None  # the rank the last consolidate_state_dict(to=...) named
        self.consolidation_hooked = False  # whether a step drops `consolidated` (hooked at the first one)
        self.saver = None  # checkpoint/background.py's Saver, from the first save_checkpoint(blocking=False)

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
    onebit = _forward("onebit", "OneBitAdam's OneBitStep (onebit_step.py), or None.")
    engine = _forward("engine", "The bucket engine, or None until a ShardedDDP attaches.")
    store = _forward("store", "The parameter store (param_store.ParamStore: members, local_parts, stream).")

    sharding = _forward("sharding", "The resolved groups (Note [Hybrid sharding] in mesh_plan.py).")
    process_group = _forward("process_group", "The shard group: the layout is split over it.")
    world_group = _forward("world_group", "Every rank of the mesh (replicas too).")
    rank = _forward("rank", "This rank in the shard group.")
    world_size = _forward("world_size", "The shard group's size.")

    state_tier = _forward("state_tier", "The optimizer-state tier (tiers/optimizer_state.StateTier) with "
                          "offload='nvme', else None.")

    def resident_pieces(self, write: bool = False):
        """Lists of piece indices whose master values and state are in memory while the list is in hand (every
        piece at once, or a bucket's at a time from the state tier); write=True: their changes are kept."""
        return self._opt.stepper.resident(read="all", write="all" if write else "none")

    def adopt_state(self) -> None:
        """State the inner optimizer was given in memory (a load) moves to the state tier, if there is one."""
        if self._opt.stepper.tier is not None:
            self._opt.stepper.tier.adopt()

    @property
    def compressing(self) -> bool:
        """OneBitAdam past its warm-up: its OneBitStep steps, and clips (Note [1-bit Adam under ZeRO])."""
        return self._opt._compressing()

    @property
    def attached(self) -> bool:
        """Whether a live ShardedDDP feeds this optimizer's gradients."""
        return self._opt.grads.attached

    def wait_params(self) -> None:
        """Returns once every parameter holds the last step's values (ShardedOptimizer.wait_params)."""
        self._opt.wait_params()

    def take_model_edits(self, saving: bool = False) -> None:
        """The masters take weights changed in place (Note [Weights edited in place] in optimizer.py)."""
        self._opt._take_model_edits(saving=saving)

    def publish_params(self) -> None:
        """Every rank's master chunks into the model (a collective)."""
        self._opt._publish_params()

    def load_master_from_model(self) -> None:
        """The master chunks take the model's values (after a load wrote the store's local parts)."""
        self._opt._load_master_from_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """ShardedOptimizer.zero_grad (gradients from before a load belong to other weights)."""
        self._opt.zero_grad(set_to_none)

    def finish_grads(self):
        """Gradients reduced (stage 3's backward rounds walked first): which parameters got one (a collective)."""
        return self._opt._grads_and_rounds()

    def after_every_step(self, fn) -> None:
        """fn(view) runs after each step() (a torch.optim step post-hook)."""
        self._opt.register_step_post_hook(lambda opt, args, kwargs: fn(opt.view))


class ModelWrapper:
    """Marker base of shardopt.ShardedDDP (its `module` and `optimizer` are public)."""


_WRAPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def wrapped_by(module, wrapper) -> None:
    _WRAPPERS[module] = weakref.ref(wrapper)


def let_go(module, wrapper=None) -> None:
    """`wrapper` let go of `module`; None: a dropped wrapper, whose entry a newer one may have replaced."""
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
