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
  * norms (torch.linalg.vector_norm, Tensor.norm; what clip_grad_norm_ calls):
    the norm of the whole averaged gradient. Every parameter's 2-norm is
    computed at the end of each reducing backward, in the small all-reduce
    that also tells which parameters got a gradient anywhere, so reading a
    2-norm is local and cheap, as with DDP: rank 0 alone may log it. Scaling
    and zeroing keep the cached norms exact; other orders (inf, 1, ...) and
    reads after clamp_ or a replaced gradient are one all-reduce for all
    parameters: a collective, as FSDP2's DTensor gradients are, so every rank
    must ask then;
  * in-place mul_/div_ by a scalar, clamp_ (clip_grad_value_), zero_: applied
    to the pieces, exactly, since they are elementwise;
  * torch._amp_foreach_non_finite_check_and_unscale_ (GradScaler.unscale_):
    unscales the pieces; found_inf is agreed over ranks (one all-reduce);
  * `full_tensor()`: the whole gradient (an all-reduce), for tools that need
    the values; a collective too;
  * anything else raises, naming what works. Casting or moving the model
    (model.half(), model.to(dtype)) lands here and is refused.
The user may also replace `p.grad`: with None (nn.Module.zero_grad) the
parameter's pieces and its "got a gradient" flag are cleared, as DDP's
gradient would be; with a tensor (a full gradient, the same on every rank),
that tensor becomes its gradient. Replacements are noticed (reconciled) at the
start of the next backward pass, and before clip_grad_norm / step read the
shard. Autograd must never accumulate into a ShardedGrad: each parameter's
tensor pre-hook swaps it out (for None at stage 2, for the flat-buffer view at
stage 1) before AccumulateGrad runs (GradSync.before_accumulate in grad_sync.py).
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

aten = torch.ops.aten

_HOW = ("what works on a sharded p.grad: torch.nn.utils.clip_grad_norm_ / clip_grad_value_, p.grad.norm(), "
        "mul_/div_/clamp_/zero_, GradScaler.unscale_, and p.grad.full_tensor() for the whole gradient (a "
        "collective: call it on every rank)")


class ShardedGrad(torch.Tensor):
    """The `.grad` of a managed parameter once its gradient is reduced (Note [Sharded p.grad])."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, shard: "GradShard", index: int):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device,
                                                requires_grad=False)
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


def _scalar(x, what: str) -> float:
    if torch.is_tensor(x):
        if x.numel() != 1:
            raise RuntimeError(f"{what} of a sharded p.grad takes a scalar, got a tensor of shape "
                               f"{tuple(x.shape)}; {_HOW}")
        return float(x.item())
    return float(x)


def _detach(g, *_):
    return ShardedGrad(g, _owner(g), g._index)


def _norm(g, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dim not in (None, [], ()):
        raise RuntimeError(f"a norm over dims {dim} of a sharded p.grad is not supported; {_HOW}")
    out = _owner(g).norms(float(ord))[g._index]
    return out.to(dtype or g.dtype).to(g.device)


def _mul(g, factor):
    _owner(g).scale(g._index, _scalar(factor, "mul_"))
    return g


def _div(g, divisor):
    _owner(g).scale(g._index, 1.0 / _scalar(divisor, "div_"))
    return g


def _clamp(g, min=None, max=None):
    lo = None if min is None else _scalar(min, "clamp_")
    hi = None if max is None else _scalar(max, "clamp_")
    _owner(g).clamp(g._index, lo, hi)
    return g


def _zero(g):
    # nn.Module.zero_grad(set_to_none=False): a zero gradient is still a gradient.
    owner = _owner(g)
    owner.zero(g._index)
    owner.keep(g._index)
    return g


def _unscale(grads, found_inf, inv_scale):
    """GradScaler.unscale_: unscale each gradient, flag inf/nan anywhere (agreed over ranks)."""
    plain = [t for t in grads if not isinstance(t, ShardedGrad)]
    sharded = [t for t in grads if isinstance(t, ShardedGrad)]
    if plain:
        torch._amp_foreach_non_finite_check_and_unscale_(plain, found_inf, inv_scale)
    if sharded:
        owner = _owner(sharded[0])
        if owner.unscale([t._index for t in sharded], float(inv_scale.item())):
            found_inf.fill_(1.0)


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
    aten.clamp_max_.default: lambda g, hi: _clamp(g, max=hi),
    aten.zero_.default: _zero,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _unscale,
}


class GradShard:
    """Per-parameter operations on this rank's gradient shard, for ShardedGrad (and its reconciling)."""

    def __init__(self, params, pieces, piece_grads, param_offsets, process_group, world_size: int, had_grad,
                 shapes=None):
        """had_grad(): per parameter, whether DDP would hold a gradient tensor for it now. shapes: the
        parameters' own shapes (at stage 3 a parameter is empty between uses, and so is its p.grad's
        stand-in, which must match it; full() still gives the whole gradient)."""
        self.shapes = [tuple(s) for s in shapes] if shapes is not None else [tuple(p.shape) for p in params]
        self.process_group = process_group
        self._had_grad = had_grad
        # Parameters whose gradient was zeroed, not set to None (zero_grad(set_to_none=False)):
        # torch.optim steps them even when no backward reaches them, since a zero tensor in
        # p.grad is still a gradient.
        self.kept = torch.zeros(len(params), dtype=torch.bool)
        self.world_size = world_size
        self._params = params
        # Per parameter: [(this rank's piece of the averaged gradient, its first element in the param)].
        self._pieces: list[list[tuple[torch.Tensor, int]]] = [[] for _ in params]
        for pc, g in zip(pieces, piece_grads):
            self._pieces[pc.param].append((g, pc.start - param_offsets[pc.param]))
        self._all = list(piece_grads)  # in piece order, as _piece_param
        self._piece_param = torch.tensor([pc.param for pc in pieces], dtype=torch.long)
        self.handles = [ShardedGrad(p, self, i) for i, p in enumerate(params)]
        self._norms: dict[float, torch.Tensor] = {}

    def changed(self) -> None:
        """The shard's values changed: cached norms are stale."""
        self._norms.clear()

    def local_square_norms(self) -> torch.Tensor:
        """Per parameter, the sum of squares of this rank's pieces (float64): summed over ranks, squared 2-norms."""
        local = torch.zeros(len(self._params), dtype=torch.float64)
        if self._all:
            part = torch.stack(torch._foreach_norm(self._all, 2)).double()
            local.index_add_(0, self._piece_param, part * part)
        return local

    def set_norms(self, ord: float, norms: torch.Tensor) -> None:
        """Every parameter's global norm of order `ord`, computed by the caller (see the Note)."""
        self._norms = {ord: norms}

    def _scale_norms(self, index, factor: float) -> None:
        for ord, norms in self._norms.items():
            if ord != 0:
                norms[index] *= abs(factor)
            elif factor == 0:
                norms[index] = 0

    # ---------------------------------------------------------------- reads
    def norms(self, ord: float) -> torch.Tensor:
        """Every parameter's global gradient norm of order `ord` (float64), from one all-reduce."""
        if ord in self._norms:
            return self._norms[ord]
        n = len(self._params)
        local = torch.zeros(n, dtype=torch.float64)
        if ord == float("inf"):
            if self._all:
                maxes = torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in self._all])
                local.scatter_reduce_(0, self._piece_param, maxes.double(), reduce="amax")
            op = dist.ReduceOp.MAX
        elif ord > 0:
            if self._all:
                part = torch.stack([torch.linalg.vector_norm(g, ord, dtype=torch.float64) for g in self._all])
                local.index_add_(0, self._piece_param, part ** ord)
            op = dist.ReduceOp.SUM
        elif ord == 0:
            if self._all:
                local.index_add_(0, self._piece_param,
                                 torch.stack([(g != 0).sum().double() for g in self._all]))
            op = dist.ReduceOp.SUM
        else:
            raise RuntimeError(f"a norm of order {ord} of a sharded p.grad is not supported; use 0, p > 0 or inf")
        if self.world_size > 1:
            dist.all_reduce(local, op=op, group=self.process_group)
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
            dist.all_reduce(flat, group=self.process_group)
        return flat.view(shape).to(dtype=p.dtype, device=p.device)

    # -------------------------------------------------------------- updates
    def scale(self, i: int, factor: float) -> None:
        for g, _ in self._pieces[i]:
            g.mul_(factor)
        self._scale_norms(i, factor)

    def scale_all(self, factor: torch.Tensor) -> None:
        """The whole shard was multiplied by `factor` (ShardedOptimizer.clip_grad_norm)."""
        self._scale_norms(slice(None), float(factor))

    def clamp(self, i: int, lo: float | None, hi: float | None) -> None:
        for g, _ in self._pieces[i]:
            g.clamp_(min=lo, max=hi)
        self.changed()

    def zero(self, i: int) -> None:
        for g, _ in self._pieces[i]:
            g.zero_()
        self._scale_norms(i, 0.0)

    def keep(self, i: int) -> None:
        """Parameter i's gradient was zeroed in place: it still has one if it had one."""
        self.kept[i] |= bool(self._had_grad()[i])

    def assign(self, i: int, grad: torch.Tensor) -> None:
        """A full gradient the user put in p.grad becomes parameter i's pieces."""
        flat = grad.detach().reshape(-1)
        for g, at in self._pieces[i]:
            g.copy_(flat[at:at + g.numel()])
        self.changed()

    def unscale(self, indices, inv_scale: float) -> bool:
        """Multiplies the parameters' pieces by inv_scale; True if any rank saw inf/nan (all-reduce)."""
        pieces = [g for i in indices for g, _ in self._pieces[i]]
        if pieces:
            torch._foreach_mul_(pieces, inv_scale)
        # One flag from all pieces, no host sync per piece.
        found = torch.stack([~torch.isfinite(g).all() for g in pieces]).any().float().reshape(1) if pieces \
            else torch.zeros(1)
        if self.world_size > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        if found.item():
            self.changed()
        else:
            self._scale_norms(torch.tensor(indices, dtype=torch.long), inv_scale)
        return bool(found.item())
