"""p.grad after a reduction: a stand-in that acts on this rank's gradient shard (Note [Sharded p.grad]).

Note [Sharded p.grad]
---------------------
Once a backward pass has reduced the gradients, the averaged gradient of a
parameter exists only as pieces spread over the ranks' gradient shards
(layout.py); no rank holds it whole, at stage 1 or 2. Everyday training code
reads `p.grad`: torch.nn.utils.clip_grad_norm_ and clip_grad_value_,
GradScaler.unscale_, gradient-norm logging (Lightning, the HF Trainer),
nn.Module.zero_grad. With `p.grad = None` (stage 2) or a zeroed view (stage 1)
all of them would silently do nothing. So after each reduction every managed
parameter's `.grad` is a ShardedGrad: a tensor with the parameter's shape,
dtype and device but no storage (a wrapper subclass, as DTensor is), whose
operations act on this rank's pieces and agree with what DDP's full gradient
would give:
  * norms (torch.linalg.vector_norm, Tensor.norm, torch._foreach_norm: what
    clip_grad_norm_ and get_total_norm call): the norm of the whole averaged
    gradient. Every parameter's 2-norm is computed at the end of each
    reducing backward, in the small all-reduce
    that also tells which parameters got a gradient anywhere, so reading a
    2-norm is local and cheap, as with DDP: rank 0 alone may log it. Scaling
    and zeroing keep the cached norms exact; other orders (inf, 1, ...) and
    reads after clamp_ or a replaced gradient are one all-reduce for all
    parameters: a collective, as FSDP2's DTensor gradients are, so every rank
    must ask then;
  * in-place mul_/div_ by a scalar, clamp_ (clip_grad_value_), zero_: applied
    to the pieces, exactly, since they are elementwise;
  * the foreach forms of all of these, which torch's own loops over
    parameters call once per list (Note [Foreach over a shard]): the cost of
    clip_grad_norm_ & co. does not grow with the number of parameters beyond
    a Python pass over the list, and no value is read on the host;
  * torch._amp_foreach_non_finite_check_and_unscale_ (GradScaler.unscale_):
    unscales the pieces; found_inf is agreed over ranks (one all-reduce) and
    stays on the device;
  * `full_tensor()`: the whole gradient (an all-reduce), for tools that need
    the values; a collective too;
  * anything else raises, naming what works. Casting or moving the model
    (model.half(), model.to(dtype)) lands here and is refused.
Every way torch offers to clip (clip_grad_norm_, get_total_norm then
clip_grads_with_norm_, _foreach_norm by hand, clip_grad_value_, with and
without foreach, 2- and inf-norms) runs against DDP at stages 1-3 in
tests/test_clip_entry_points.py: libraries change which one they call.
The user may also replace `p.grad`: with None (nn.Module.zero_grad) the
parameter's pieces and its "got a gradient" flag are cleared, as DDP's
gradient would be; with a tensor (a full gradient, the same on every rank),
that tensor becomes its gradient. Replacements are noticed (reconciled) at the
start of the next backward pass, and before clip_grad_norm / step read the
shard. Autograd must never accumulate into a ShardedGrad: the first gradient
hook of a backward pass swaps them all out (for None at stages 2-3, for the
flat-buffer view at stage 1) before AccumulateGrad runs (GradSync.begin_backward
in grad_sync.py).
"""
from __future__ import annotations

import math
import operator
import sys
import weakref

import torch
import torch.distributed as dist
from torch.utils import _foreach_utils

from shardopt.parallel import comm

aten = torch.ops.aten

_HOW = ("what works on a sharded p.grad: torch.nn.utils.clip_grad_norm_ / clip_grad_value_ / get_total_norm / "
        "clip_grads_with_norm_, torch._foreach_norm, p.grad.norm(), "
        "mul_/div_/clamp_/zero_, GradScaler.unscale_, and p.grad.full_tensor() for the whole gradient (a "
        "collective: call it on every rank)")


class ShardedGrad(torch.Tensor):
    """The `.grad` of a managed parameter once its gradient is reduced (Note [Sharded p.grad])."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, shard: "GradShard", index: int, shape=None):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape if shape is None else shape, dtype=param.dtype,
                                                device=param.device, requires_grad=False)
        t._shard = weakref.ref(shard)
        t._index = index
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return (f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}: parameter {self._index}'s reduced "
                f"gradient, held in pieces by the ranks' ShardedOptimizer shards; p.grad.full_tensor() gathers it)")

    def full_tensor(self) -> torch.Tensor:
        """The whole averaged gradient, on every rank (an all-reduce: call it on every rank)."""
        return _owner(self).full(self._index)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            raise RuntimeError(
                f"{func} is not supported on the gradient of a ShardedOptimizer parameter: after backward, "
                f"each rank holds only its shard of the averaged gradient (Note [Sharded p.grad] in "
                f"shardopt/sharded_grad.py). If this came from model.half() / model.to(dtype) / "
                f"model.to(device) after wrapping: cast or move the model before building the ShardedOptimizer. "
                f"Otherwise, {_HOW}.")
        return handler(*args, **kwargs)


def _owner(g: ShardedGrad) -> "GradShard":
    shard = g._shard()
    if shard is None:
        raise RuntimeError("this gradient belonged to a ShardedOptimizer that no longer exists")
    return shard


def _check_scalar(x, what: str):
    """A Python number or a one-element tensor, kept as it is: reading a tensor's value would stall a GPU."""
    if torch.is_tensor(x) and x.numel() != 1:
        raise RuntimeError(f"{what} of a sharded p.grad takes a scalar, got a tensor of shape {tuple(x.shape)}; "
                           f"{_HOW}")
    return x


def _detach(g, *_):
    return ShardedGrad(g, _owner(g), g._index)


def _norm(g, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dim not in (None, [], ()):
        raise RuntimeError(f"a norm over dims {dim} of a sharded p.grad is not supported; {_HOW}")
    return _owner(g).norm_list([g._index], float(ord), dtype or g.dtype, g.device)[0]


def _mul(g, factor):
    _owner(g).scale([g._index], _check_scalar(factor, "mul_"))
    return g


def _div(g, divisor):
    divisor = _check_scalar(divisor, "div_")
    _owner(g).scale([g._index], torch.reciprocal(divisor) if torch.is_tensor(divisor) else 1.0 / divisor)
    return g


def _clamp(g, min=None, max=None):
    _owner(g).clamp([g._index], _check_scalar(min, "clamp_"), _check_scalar(max, "clamp_"))
    return g


def _zero(g):
    # nn.Module.zero_grad(set_to_none=False): a zero gradient is still a gradient.
    owner = _owner(g)
    owner.zero([g._index])
    owner.keep([g._index])
    return g


# ------------------------------------------------------------------- foreach
# Note [Foreach over a shard]
# torch's own loops over model.parameters() (clip_grad_norm_, clip_grad_value_,
# get_total_norm, GradScaler.unscale_) group the gradients by device and dtype
# and make one foreach call per group when every gradient's type is in
# torch.utils._foreach_utils._foreach_supported_types; otherwise one call per
# gradient. ShardedGrad is added to that list (as DTensor adds itself), so such
# a loop reaches __torch_dispatch__ once with the whole list, and the handlers
# below act on the shard once: a norm per parameter is one lookup in the norms
# cached at the end of backward; scaling, clamping and zeroing touch the whole
# gradient shard in one kernel when the list holds every parameter whose p.grad
# is its ShardedGrad (a Trainer's model.parameters()), else the listed
# parameters' pieces in one foreach call. The usual lists, every gradient in
# the shard's order or in the model's (ShardedDDP hands it over), are known
# in one identity pass over the list, without a lookup per tensor. Scale
# factors stay tensors (torch's clip coefficient, GradScaler's inv_scale): no
# value is read on the host, so nothing waits for the device. A list may mix
# ShardedGrads (of one or several optimizers) with plain tensors (parameters
# no ShardedOptimizer manages): those get the plain op.
def _split(tensors):
    """(positions of plain tensors, {GradShard: (positions, parameter indices)}) of a foreach op's list."""
    # The usual list (model.parameters()' gradients, one optimizer) in C loops, not one Python step each.
    if tensors and type(tensors[0]) is ShardedGrad:
        owner = _owner(tensors[0])
        # Every handle in the shard's order (one parameter group, every gradient present), or in the model's
        # (groups that order them otherwise): `every` / `every_in_model_order`, which the shard's methods
        # recognise by identity and take as the whole shard at once.
        if len(tensors) == len(owner.handles):
            if all(map(operator.is_, tensors, owner.handles)):
                return [], {owner: (owner.every, owner.every)}
            if all(map(operator.is_, tensors, owner.handles_in_model_order)):
                return [], {owner: (owner.every, owner.every_in_model_order)}
        # Else every tensor one of that shard's handles, looked up by identity (the shard holds them).
        try:
            return [], {owner: (range(len(tensors)), list(map(owner.index_of.__getitem__, map(id, tensors))))}
        except KeyError:  # not all of them
            pass
    plain, shards = [], {}
    for pos, t in enumerate(tensors):
        if isinstance(t, ShardedGrad):
            positions, indices = shards.setdefault(_owner(t), ([], []))
            positions.append(pos)
            indices.append(t._index)
        else:
            plain.append(pos)
    return plain, shards


_SHARD, _INDEX = operator.attrgetter("_shard"), operator.attrgetter("_index")


# Note [torch's total norm in one piece]
# torch.nn.utils.clip_grad_norm_ (and get_total_norm, the same code) asks
# _foreach_norm for one norm per gradient, then takes
#     vector_norm(torch.stack([n.to(first_device) for n in norms]), norm_type)
# Under ShardedDDP the per-parameter norms are already one tensor, so thousands
# of 0-d tensors made from it, moved one by one and stacked back into one, are
# all the work there is: at 8000 parameters (one CPU process) torch's clip took
# 27-37 ms and takes 17 ms without them; opt.clip_grad_norm takes 0.6 ms.
# When the op's caller is that torch function (its code object, two frames
# above _foreach_norm: __torch_dispatch__, then torch's frame) and the list is
# all of its tensors, of one shard, _foreach_norm answers with one tensor: the
# norms in the list's order. torch then stacks one tensor instead of thousands
# and vector_norm reads the same values in the same order: the total, and so
# the clip, is bit for bit the one from per-gradient norms (tests/test_idioms.py).
# Every other caller, a list that mixes shards or plain tensors, and a torch
# without _get_total_norm (older versions) get one norm per gradient.
_TOTAL_NORM = getattr(getattr(torch.nn.utils.clip_grad, "_get_total_norm", None), "__wrapped__", None)
_TOTAL_NORM_CODE = getattr(_TOTAL_NORM, "__code__", None)


def _total_norm_of_all(tensors) -> bool:
    """Whether torch's total-norm code called _foreach_norm with all of its tensors (Note above)."""
    try:
        caller = sys._getframe(3)  # 0: this, 1: _foreach_norm, 2: __torch_dispatch__, 3: who called the op
    except ValueError:  # called from C++ with no Python caller
        return False
    return caller.f_code is _TOTAL_NORM_CODE and len(caller.f_locals.get("tensors", ())) == len(tensors)


def _foreach_norm(tensors, ord=2, dtype=None):
    plain, shards = _split(tensors)
    if not plain and len(shards) == 1 and _total_norm_of_all(tensors):
        ((owner, (_, indices)),) = shards.items()
        return [owner.norm_vector(indices, float(ord), dtype or tensors[0].dtype, tensors[0].device)]
    out = [None] * len(tensors)
    if plain:
        for pos, n in zip(plain, aten._foreach_norm.Scalar([tensors[i] for i in plain], ord, dtype=dtype)):
            out[pos] = n
    for owner, (positions, indices) in shards.items():
        first = tensors[positions[0]]
        for pos, n in zip(positions, owner.norm_list(indices, float(ord), dtype or first.dtype, first.device)):
            out[pos] = n
    return out


def _foreach_update(op, update):
    """A foreach in-place op: `op` on the plain tensors, update(owner, indices, *args) on each shard."""
    def handler(tensors, *args):
        plain, shards = _split(tensors)
        if plain:
            op([tensors[i] for i in plain], *args)
        for owner, (_, indices) in shards.items():
            update(owner, indices, *args)
    return handler


def _foreach_zero(owner, indices):
    owner.zero(indices)
    owner.keep(indices)


def _foreach_div(owner, indices, divisor):
    owner.scale(indices, torch.reciprocal(divisor) if torch.is_tensor(divisor) else 1.0 / divisor)


def _unscale(grads, found_inf, inv_scale):
    """GradScaler.unscale_: unscale each gradient, flag inf/nan anywhere (agreed over ranks, kept on device)."""
    plain, shards = _split(grads)
    if plain:
        torch._amp_foreach_non_finite_check_and_unscale_([grads[i] for i in plain], found_inf, inv_scale)
    for owner, (_, indices) in shards.items():
        found = owner.unscale(indices, inv_scale)
        found_inf.copy_(torch.maximum(found_inf, found.to(found_inf.device, found_inf.dtype).reshape(found_inf.shape)))


_HANDLERS = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.linalg_vector_norm.default: _norm,
    aten.mul_.Tensor: _mul,
    aten.mul_.Scalar: _mul,
    aten.div_.Tensor: _div,
    aten.div_.Scalar: _div,
    aten.clamp_.default: _clamp,
    aten.clamp_.Tensor: _clamp,
    aten.clamp_min_.default: lambda g, lo: _clamp(g, min=lo),
    aten.clamp_min_.Tensor: lambda g, lo: _clamp(g, min=lo),
    aten.clamp_max_.default: lambda g, hi: _clamp(g, max=hi),
    aten.clamp_max_.Tensor: lambda g, hi: _clamp(g, max=hi),
    aten.zero_.default: _zero,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten._foreach_mul_.Scalar: _foreach_update(torch._foreach_mul_, lambda o, i, f: o.scale(i, f)),
    aten._foreach_mul_.Tensor: _foreach_update(torch._foreach_mul_, lambda o, i, f: o.scale(i, f)),
    aten._foreach_div_.Scalar: _foreach_update(torch._foreach_div_, _foreach_div),
    aten._foreach_div_.Tensor: _foreach_update(torch._foreach_div_, _foreach_div),
    aten._foreach_clamp_min_.Scalar: _foreach_update(torch._foreach_clamp_min_, lambda o, i, lo: o.clamp(i, lo, None)),
    aten._foreach_clamp_max_.Scalar: _foreach_update(torch._foreach_clamp_max_, lambda o, i, hi: o.clamp(i, None, hi)),
    aten._foreach_zero_.default: _foreach_update(torch._foreach_zero_, _foreach_zero),
    aten._amp_foreach_non_finite_check_and_unscale_.default: _unscale,
}

# Note [Foreach over a shard]: torch's loops over parameters take the foreach path for ShardedGrad. First in
# the list: torch checks every gradient's type against it (`type(t) in ...`), and a hit there ends the scan.
if ShardedGrad not in _foreach_utils._foreach_supported_types:
    _foreach_utils._foreach_supported_types.insert(0, ShardedGrad)


# Note [Norms live with the gradients]
# -------------------------------------
# Per-parameter gradient norms (every 2-norm at the end of backward, other
# orders when asked) are float64 tensors on the gradient shard's device: on a
# GPU they are computed, all-reduced and kept there, and torch's
# clip_grad_norm_, opt.clip_grad_norm, GradScaler's unscale and norm logging
# launch kernels on them without waiting for the device (a clip coefficient
# scales the cached norms on the device too). The host reads per step only what
# it decides with: which parameters have a gradient (p.grad None or not; a host
# tensor, all-reduced through the GPU on NCCL, Note [Host bookkeeping on NCCL])
# and whether a gradient is inf/nan (skip or raise, as GradScaler reads it).
# With offload the shard is in host memory, and so are its norms. On a GPU,
# norms on the host made 4 host syncs per step with torch's clip_grad_norm_, on
# the device 1 (benchmarks/results/, the GPU check).


class GradShard:
    """Operations on this rank's gradient shard for ShardedGrad, on lists of parameters (and its reconciling)."""

    def __init__(self, params, pieces, piece_grads, param_offsets, process_group, world_size: int, had_grad,
                 shapes=None, *, device, resting=None):
        """had_grad(): per parameter, whether DDP would hold a gradient tensor for it now. shapes: the
        parameters' own shapes (at stage 3 a parameter is empty between uses, and so is its p.grad's
        stand-in, which must match it; full() still gives the whole gradient). device: the gradient
        shard's, the same on every rank (a rank whose chunks hold only padding has no pieces to ask), where
        the norms live. resting: per parameter, its shape between uses (the store's resting_shape: a stage-3
        parameter of a persistent bucket is whole even where a meta model has no values yet), else its own."""
        self.shapes = [tuple(s) for s in shapes] if shapes is not None else [tuple(p.shape) for p in params]
        self.process_group = process_group
        self._had_grad = had_grad
        # installed(): per parameter, what GradSync last put in its .grad (Note [What a list leaves out]).
        self.installed = lambda: [p.grad for p in params]
        # Parameters whose gradient was zeroed, not set to None (zero_grad(set_to_none=False)):
        # torch.optim steps them even when no backward reaches them, since a zero tensor in
        # p.grad is still a gradient. Zeroing only notes the index; `kept` settles the notes.
        self._kept = torch.zeros(len(params), dtype=torch.bool)
        self._pending_keep: list[int] = []
        # GradScaler.unscale_ went over these gradients since they were last zeroed: an inf/nan is then the
        # scaler's to handle (it skips the step), not a divergence (Note [GradScaler owns the inf]).
        self.unscaled_by_amp = False
        self.world_size = world_size
        self._params = params
        # Per parameter: [(this rank's piece of the averaged gradient, its first element in the param)].
        self._pieces: list[list[tuple[torch.Tensor, int]]] = [[] for _ in params]
        for pc, g in zip(pieces, piece_grads):
            self._pieces[pc.param].append((g, pc.start - param_offsets[pc.param]))
        self._all = list(piece_grads)  # in piece order, as _piece_param
        self.device = torch.device(device)  # Note [Norms live with the gradients]
        # Per parameter: clamped since the last backward by a finite lower / upper bound (clip_grad_value_):
        # an inf there is gone (Note [A clamped gradient loses its inf] in grad_sync.py). `clamped_any`: some was.
        self.clamped = torch.zeros(len(params), 2, dtype=torch.bool, device=self.device)
        self.clamped_any = False
        self._piece_param = torch.tensor([pc.param for pc in pieces], dtype=torch.long).to(self.device)
        nonempty = [k for k, g in enumerate(self._all) if g.numel()]
        self._nonempty = [self._all[k] for k in nonempty]
        self._nonempty_param = self._piece_param[nonempty]
        # The whole gradient shard, the pieces' storage (GradSync hands it over); None: pieces only.
        self.flat: torch.Tensor | None = None
        self.handles = [ShardedGrad(p, self, i, None if resting is None else resting[i]) for i, p in enumerate(params)]
        self.every = range(len(params))  # the list of every parameter, in order (known by identity: _select)
        self.set_model_order(list(self.every))
        self.index_of = {id(h): i for i, h in enumerate(self.handles)}  # handle -> parameter index
        self._norms: dict[float, torch.Tensor] = {}

    @property
    def kept(self) -> torch.Tensor:
        """Per parameter: its gradient was zeroed in place and still counts as one (see __init__)."""
        if self._pending_keep:
            idx = torch.tensor(self._pending_keep, dtype=torch.long)
            self._pending_keep = []
            self._kept[idx] |= self._had_grad()[idx]
        return self._kept

    @kept.setter
    def kept(self, value: torch.Tensor) -> None:
        self._kept = value

    def changed(self) -> None:
        """The shard's values changed: cached norms are stale."""
        self._norms.clear()

    def local_square_norms(self) -> torch.Tensor:
        """Per parameter, the sum of squares of this rank's pieces (float64): summed over ranks, squared 2-norms."""
        local = torch.zeros(len(self._params), dtype=torch.float64, device=self.device)
        if self._all:
            part = torch.stack(torch._foreach_norm(self._all, 2)).double()
            local.index_add_(0, self._piece_param, part * part)
        return local

    def set_norms(self, ord: float, norms: torch.Tensor) -> None:
        """Every parameter's global norm of order `ord`, computed by the caller (see the Note)."""
        self._norms = {ord: norms}

    def set_model_order(self, order: list[int]) -> None:
        """Every parameter index in the model's order (ShardedDDP's, through GradSync.order_norms_as): the
        list of every gradient in that order is then known at once too (_split), and clip totals sum the
        norms in it (GradSync.norms_in_model_order; `model_order` is that index on the CPU)."""
        self.every_in_model_order = list(order)
        self.handles_in_model_order = [self.handles[i] for i in order]
        self.model_order = torch.tensor(order, dtype=torch.long)
        self._model_order_index = self.model_order.to(self.device)

    def _whole(self, indices) -> bool:
        """Whether `indices` is one of the shard's lists of every parameter (known by identity)."""
        return indices is self.every or indices is self.every_in_model_order

    def _select(self, indices):
        """An index for per-parameter tensors: everything, or the listed parameters."""
        if indices is self.every:
            return slice(None)
        if indices is self.every_in_model_order:
            return self._model_order_index
        if len(indices) == len(self._params) and indices == list(range(len(self._params))):
            return slice(None)
        # Note [Norms live with the gradients]: the per-parameter tensors may be on a GPU, where indexing with a
        # host tensor copies it there from pageable memory, and the host waits (one sync per p.grad.norm() in
        # a logging loop, seen on an H200). One parameter: a slice, no index tensor; a list: a pinned copy.
        if len(indices) == 1:
            return slice(indices[0], indices[0] + 1)
        index = torch.tensor(indices, dtype=torch.long)
        if self.device.type != "cpu":
            index = index.pin_memory().to(self.device, non_blocking=True)
        return index

    def _scale_norms(self, indices, factor) -> None:
        """Cached norms of the listed parameters after their gradients were multiplied by `factor`."""
        if not self._norms:
            return
        sel = self._select(indices)
        if torch.is_tensor(factor):
            a = factor.detach().to(torch.float64).abs().to(self.device).reshape(())  # no host read
        else:
            a = abs(float(factor))
        whole = (isinstance(sel, slice) and sel == slice(None)) or self._whole(indices)
        for ord, norms in self._norms.items():
            if ord != 0 and whole:  # every parameter: in place, no write back
                norms.mul_(a)
            elif ord != 0:
                norms[sel] *= a
            elif torch.is_tensor(a):
                norms[sel] = torch.where(a == 0, torch.zeros((), dtype=norms.dtype, device=norms.device), norms[sel])
            elif a == 0:
                norms[sel] = 0

    def _targets(self, indices, keeps_zero: bool = True) -> list[torch.Tensor]:
        """What an elementwise update of the listed parameters' gradients touches (Note [Foreach over a shard]).

        The whole shard, one tensor, when the list holds every parameter whose
        p.grad is its ShardedGrad (and the update keeps zeros zero: the rest of
        the shard is padding or parameters without a gradient, zeros that a
        later backward accumulates into); else the listed parameters' pieces.
        """
        if self.flat is not None and keeps_zero:
            if self._whole(indices):
                return [self.flat] if self.flat.numel() else []
            listed, n = set(indices), len(self._params)
            # The scan over every parameter only for lists of at least half of them: O(1) per listed
            # gradient (a per-parameter loop such as nn.Module.zero_grad must not cost O(n) each).
            if len(listed) == n or (2 * len(listed) >= n and all(
                    i in listed for i, (put, h) in enumerate(zip(self.installed(), self.handles)) if put is h)):
                return [self.flat] if self.flat.numel() else []
        return [g for i in indices for g, _ in self._pieces[i]]

    # Note [What a list leaves out]
    # The whole shard stands for a list when what the list leaves out holds zeros: padding, and parameters
    # with no gradient this step. A gradient that user code cleared (p.grad = None) or replaced by a tensor
    # after backward still has its reduced values in the shard until GradSync.reconcile() takes the change in
    # (at the step, the next backward or zero_grad). So the test is against what GradSync installed, not
    # p.grad now: a parameter whose installed ShardedGrad is missing from the list sends the call to the
    # listed pieces. (Seen: fp16 under torch.amp.GradScaler, a p.grad holding an overflow cleared or replaced
    # before unscale_: the scaler still found the inf in the shard and skipped a step DDP takes.)

    # ---------------------------------------------------------------- reads
    def norm_vector(self, indices, ord: float, dtype, device) -> torch.Tensor:
        """The listed parameters' global gradient norms, one tensor of `dtype` on `device`, in the list's order
        (a new tensor: the cached norms are scaled in place with the gradients)."""
        sel = self._select(indices)
        # Indexing by a tensor copies already; only the whole-list slice is a view of the cache.
        return self.norms(ord)[sel].to(dtype=dtype, device=device, copy=isinstance(sel, slice))

    def norm_list(self, indices, ord: float, dtype, device) -> list[torch.Tensor]:
        """The listed parameters' global gradient norms, as 0-d tensors of `dtype` on `device`."""
        out = self.norm_vector(indices, ord, dtype, device)
        # Below the view-tracking key: independent 0-d tensors (no view of `out`, which nobody else holds),
        # 4x cheaper than tracked views at thousands of parameters.
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return list(out.unbind(0))

    def cached_norms(self, ord: float) -> torch.Tensor | None:
        """Every parameter's global gradient norm of order `ord` if known without a collective, else None (an
        edit that is no scaling, as a clamp, forgets them)."""
        return self._norms.get(ord)

    def norms(self, ord: float) -> torch.Tensor:
        """Every parameter's global gradient norm of order `ord` (float64), from one all-reduce."""
        if ord in self._norms:
            return self._norms[ord]
        n = len(self._params)
        local = torch.zeros(n, dtype=torch.float64, device=self.device)
        pieces, owner = self._nonempty, self._nonempty_param
        if ord == float("inf"):
            if pieces:
                maxes = torch.stack(torch._foreach_norm(pieces, ord)).double()
                local.scatter_reduce_(0, owner, maxes, reduce="amax")
            op = dist.ReduceOp.MAX
        elif ord == 2:
            local = self.local_square_norms()  # as at the end of backward
            op = dist.ReduceOp.SUM
        elif ord > 0:
            # Per piece in the pieces' dtype (a float64 _foreach_norm copies every piece first: 5x slower
            # at 8000 pieces), summed over pieces and ranks in float64.
            if pieces:
                local.index_add_(0, owner, torch.stack(torch._foreach_norm(pieces, ord)).double() ** ord)
            op = dist.ReduceOp.SUM
        elif ord == 0:
            if pieces:
                local.index_add_(0, owner, torch.stack(torch._foreach_norm(pieces, 0)).double())
            op = dist.ReduceOp.SUM
        else:
            raise RuntimeError(f"a norm of order {ord} of a sharded p.grad is not supported; use 0, p > 0 or inf")
        if self.world_size > 1:
            comm.all_reduce(local, self.process_group, f"gradient norms of order {ord}", op=op)
        out = local if ord in (0.0, float("inf")) else local ** (1.0 / ord)
        self._norms[ord] = out
        return out

    def full(self, i: int) -> torch.Tensor:
        """Parameter i's whole averaged gradient (an all-reduce of every rank's pieces)."""
        p, shape = self._params[i], self.shapes[i]
        dtype = self._all[0].dtype if self._all else torch.float32
        flat = torch.zeros(math.prod(shape), dtype=dtype)
        for g, at in self._pieces[i]:
            flat[at:at + g.numel()].copy_(g)
        if self.world_size > 1:
            comm.all_reduce(flat, self.process_group, f"parameter {i}'s whole gradient")
        return flat.view(shape).to(dtype=p.dtype, device=p.device)

    # -------------------------------------------------------------- updates
    # Each takes a list of parameter indices (Note [Foreach over a shard]); factors and bounds may be
    # Python numbers or one-element tensors, used as they are.
    def scale(self, indices, factor) -> None:
        targets = self._targets(indices)
        if targets:
            f = factor.to(targets[0].device).reshape(()) if torch.is_tensor(factor) else factor
            torch._foreach_mul_(targets, f)
        self._scale_norms(indices, factor)

    def scale_all(self, factor) -> None:
        """The whole shard was multiplied by `factor` (ShardedOptimizer.clip_grad_norm)."""
        self._scale_norms(self.every, factor)

    def clamp(self, indices, lo, hi) -> None:
        if torch.is_tensor(lo) or torch.is_tensor(hi):  # tensor bounds (rare): piece by piece
            for t in self._targets(indices, keeps_zero=False):
                t.clamp_(min=None if lo is None else torch.as_tensor(lo).to(t.device),
                         max=None if hi is None else torch.as_tensor(hi).to(t.device))
        else:
            targets = self._targets(indices, keeps_zero=(lo is None or lo <= 0) and (hi is None or hi >= 0))
            if targets and lo is not None:
                torch._foreach_clamp_min_(targets, lo)
            if targets and hi is not None:
                torch._foreach_clamp_max_(targets, hi)
        self.changed()
        idx = self._select(indices)
        for side, bound in enumerate((lo, hi)):
            if torch.is_tensor(bound):  # a tensor op: no host read
                self.clamped[idx, side] |= torch.isfinite(bound.to(self.device).reshape(()))
            elif bound is not None and math.isfinite(bound):
                self.clamped[idx, side] = True
        self.clamped_any = True

    def forget_clamps(self) -> None:
        if self.clamped_any:
            self.clamped.zero_()
            self.clamped_any = False

    def forget_step_marks(self) -> None:
        """At a step's end or zero_grad: no unscale_ by GradScaler, no clamp since."""
        self.unscaled_by_amp = False
        self.forget_clamps()

    def zero(self, indices) -> None:
        targets = self._targets(indices)
        if targets:
            torch._foreach_zero_(targets)
        self._scale_norms(indices, 0.0)

    def keep(self, indices) -> None:
        """The listed parameters' gradients were zeroed in place: each still has one if it had one."""
        self._pending_keep.extend(indices)

    def assign(self, i: int, grad: torch.Tensor) -> None:
        """A full gradient the user put in p.grad becomes parameter i's pieces."""
        if tuple(grad.shape) != self.shapes[i]:
            raise ValueError(
                f"a parameter of shape {self.shapes[i]} had its p.grad replaced by a tensor of shape "
                f"{tuple(grad.shape)}; a replaced p.grad must be the parameter's whole gradient. At stage 3 a "
                f"parameter is empty outside a forward (so is torch.ones_like(p)): build the replacement inside "
                f"opt.full_params(), or change the gradient in place (p.grad.mul_(...), "
                f"torch.nn.utils.clip_grad_norm_), which works at every stage.")
        flat = grad.detach().reshape(-1)
        for g, at in self._pieces[i]:
            g.copy_(flat[at:at + g.numel()])
        self.changed()

    def unscale(self, indices, inv_scale: torch.Tensor) -> torch.Tensor:
        """Multiplies the listed gradients by inv_scale; returns a one-element tensor, 1 if some rank saw inf/nan.

        One all-reduce; nothing is read on the host. The cached norms scale with
        the gradients (an inf or nan stays one, as in the unscaled gradient).
        """
        self.unscaled_by_amp = True
        targets = self._targets(indices)
        device = targets[0].device if targets else torch.device("cpu")
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if targets:
            torch._amp_foreach_non_finite_check_and_unscale_(targets, found, inv_scale.to(device))
        if self.world_size > 1:
            comm.all_reduce(found, self.process_group, "unscale's inf/nan flag", op=dist.ReduceOp.MAX)
        self._scale_norms(indices, inv_scale)
        return found
