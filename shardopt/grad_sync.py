"""Gradient sync: the end of each backward pass, the one all-reduce of flags a step needs, and what p.grad
holds in between (Note [Sharded p.grad] in sharded_grad.py).

    backward   -> ShardedDDP's hooks (C++ at every stage, Note [Gradient hooks in C++] in csrc/comm/grad_hooks.h):
                  begin_backward() once, then the engine takes each gradient without Python
    end        -> end_backward(): flush the engine, one all-reduce of (got a gradient, 2-norms, the step's
                  flags), every reached parameter's p.grad becomes its ShardedGrad
    step/clip  -> finish(): the global "got a gradient" flags and "some rank saw inf/nan", once per step:
                  from that all-reduce (Note [The step's flags ride the end of backward])
"""
from __future__ import annotations

import operator
import time

import torch
import torch.distributed as dist

from shardopt import _ext
from shardopt.config import ShardConfig
from shardopt.layout import Layout
from shardopt.parallel import comm
from shardopt.sharded_grad import GradShard, ShardedGrad

_GRAD = operator.attrgetter("grad")


def build_engine(layout: Layout, launch_order, gather_order, config: ShardConfig, process_group, grad_dtype,
                 reduce_dtype, device, copy_device, flat_grad: torch.Tensor, shard_grad: torch.Tensor, *,
                 waits_in_backward: bool):
    """The C++ bucket engine for this layout (Note [Bucket engine] in csrc/comm/bucket_engine.h).

    launch_order: buckets in the order every rank reduces them (layout.plan_launch_order);
    gather_order: indices into layout.gather_spans, in the order the forward needs them
    (prefetch.plan_gather_order); flat_grad: the full-size gradient buffer the parameters' .grad are views
    of (stage 1), or an empty tensor (only this rank's chunks are kept, in shard_grad); waits_in_backward:
    the parameter store's answer (Note [Stage 3 never waits in backward])."""
    plan = _ext._C.BucketPlan()
    plan.bucket_start = [b.start for b in layout.buckets]
    plan.bucket_numel = [b.numel for b in layout.buckets]
    plan.bucket_params = [list(b.params) for b in layout.buckets]
    plan.param_offset = [p.offset for p in layout.params]
    plan.param_numel = [p.numel for p in layout.params]
    plan.launch_order = list(launch_order)
    if sorted(gather_order) != list(range(len(layout.gather_spans))):
        raise ValueError("gather_order must be a permutation of the layout's gather spans")
    spans = [layout.gather_spans[i] for i in gather_order]
    plan.gather_bucket = [g.bucket for g in spans]
    plan.gather_lo = [g.lo for g in spans]
    plan.gather_hi = [g.hi for g in spans]
    opts = _ext._C.EngineOptions()
    opts.stage = 1 if flat_grad.numel() else 2  # the engine's two ways: full-size gradients kept, or chunks only
    opts.wait_for_staging = waits_in_backward
    opts.num_staging = config.num_staging_buffers
    opts.overlap = config.overlap_comm
    opts.impl = config.comm_impl
    opts.grad_dtype = grad_dtype
    opts.reduce_dtype = reduce_dtype
    opts.device = device
    opts.copy_device = copy_device
    return _ext._C.BucketEngine(process_group, plan, opts, flat_grad, shard_grad)


class GradSync:
    """What a ShardedOptimizer knows about gradients between two steps."""

    def __init__(self, params: list, resting_grads: list, shard_grad: torch.Tensor, grad_shard: GradShard,
                 world_group, replicas: int, nonfinite: str, phase: dict, loss_scaled: bool = False):
        self.params = params
        self.shard_grad = shard_grad  # this rank's chunks of the averaged gradient, concatenated
        # Per parameter, what its .grad holds while autograd accumulates (the parameter store's answer):
        # stage 1 its view of the full-size gradient buffer, else None (the gradient is released once reduced).
        self.resting = resting_grads
        self.full_grads = any(g is not None for g in resting_grads)
        self.shard = grad_shard
        grad_shard.flat = shard_grad  # its pieces are views of it (Note [Foreach over a shard])
        grad_shard.installed = lambda: self.installed  # Note [What a list leaves out] in sharded_grad.py
        self.world_group = world_group
        self.replicas = replicas
        self.nonfinite = nonfinite
        # Without loss scaling an inf that clip_grad_value_ clamped away is gone (Note [A clamped gradient loses
        # its inf]); with it, the inf says the scale overflowed, and the step is skipped whatever came after.
        self.clamp_clears_inf = not loss_scaled
        self.phase = phase
        self.engine = None         # created by ShardedDDP (it knows the model's parameter order)
        self.attached = False      # a live ShardedDDP feeds the engine (Note [Hooks die with the wrapper])
        # installed[i] is what this optimizer last put in parameter i's .grad: its ShardedGrad, its
        # stage-1 view, or None.
        self.installed: list = list(resting_grads)
        self.last_used = torch.zeros(len(params), dtype=torch.bool)  # global, at the last step
        self.handles_out = False   # some installed[i] may be a ShardedGrad (else reconcile has nothing to do)
        self.backwards = 0         # backward passes reduced since the last step
        self.global_used = None    # per parameter: got a gradient on some rank (cached until step)
        self.found_nonfinite = False  # some rank's gradients held inf/nan (valid with global_used)
        # Note [The step's flags ride the end of backward]: what the last end-of-backward all-reduce said
        # (per parameter: used anywhere; some rank reached a parameter; some rank saw inf/nan; per parameter:
        # its gradient holds inf/nan, holds nan), and this rank's p.grad replacements since then (parameter ->
        # (has a gradient now, it holds inf/nan)). None: finish() all-reduces them.
        self.flags_at_end: tuple[torch.Tensor, bool, bool, torch.Tensor, torch.Tensor] | None = None
        self.replaced_since: dict[int, tuple[bool, bool]] = {}
        # The index of the parameters with a gradient in the order clip totals sum their norms (Note [Norms
        # summed in the model's order]; the shard holds that order), kept until that set changes.
        self._norm_pick: tuple[torch.Tensor, torch.Tensor] | None = None  # (who had a gradient, its index)

    def require_engine(self):
        if not self.attached:
            raise RuntimeError("no gradients reach this ShardedOptimizer: wrap the model with "
                               "shardopt.ShardedDDP(model, optimizer) before training (and keep the wrapper: "
                               "once it is garbage-collected its hooks are gone)")
        return self.engine

    def detach(self) -> None:
        """Gradients no longer reach the engine (the wrapper is gone): nothing answers for a ShardedGrad."""
        for i, p in enumerate(self.params):
            if isinstance(p.grad, ShardedGrad):
                p.grad = None
            self.installed[i] = p.grad
        self.handles_out = False
        self.attached = False

    # Note [Norms summed in the model's order]
    # -----------------------------------------
    # The total of torch's clip_grad_norm_(model.parameters()) is vector_norm of the per-parameter norms
    # of the gradients that exist, in the model's order. The optimizer's own order is its groups' (the HF
    # Trainer puts decayed parameters before the rest), and a norm of the same values in another order can
    # differ in the last bit: the clip coefficient then differs by an ulp, which bf16 autocast amplifies
    # past the parity bars within a few steps (seen on a GPU and on the CPU, 2026-11-26). ShardedDDP hands
    # its module's order over (order_norms_as), and the norms skip the parameters without a gradient, as
    # torch's do.
    def order_norms_as(self, order: list[int]) -> None:
        """Parameter indices in the model's order (those it does not list follow in this optimizer's)."""
        seen = set(order)
        self.shard.set_model_order(list(order) + [i for i in range(len(self.params)) if i not in seen])
        self._norm_pick = None

    def norms_in_model_order(self, ord: float) -> torch.Tensor:
        """Every global per-parameter norm of order `ord` of the parameters with a gradient, in the model's
        order (Note above). The index goes to the norms' device only when that set changes."""
        norms = self.shard.norms(ord)
        had = self.had_grad()
        if self._norm_pick is None or not torch.equal(self._norm_pick[0], had):
            order = self.shard.model_order
            self._norm_pick = (had, order[had[order]].to(norms.device))
        return norms[self._norm_pick[1]]

    def had_grad(self) -> torch.Tensor:
        """Per parameter: whether DDP + torch.optim would hold a gradient tensor for it (p.grad not None)."""
        used = self.engine.used().bool() if self.engine is not None else torch.zeros_like(self.last_used)
        return used | self.last_used | self.shard.kept

    # ------------------------------------------------------------- backward
    def begin_backward(self) -> None:
        """A backward pass starts (the first C++ hook: Note [Gradient hooks in C++] in csrc/comm/grad_hooks.h).

        Take in what user code did to p.grad (Note [Sharded p.grad]), then no p.grad
        holds a ShardedGrad while autograd accumulates.
        """
        if not self.handles_out:
            return  # no ShardedGrad was installed since the last zero_grad
        self.reconcile()
        for i, p in enumerate(self.params):
            if isinstance(p.grad, ShardedGrad):
                p.grad = self.installed[i] = self.resting[i]

    # Note [The step's flags ride the end of backward]
    # --------------------------------------------------
    # A step needs three answers from every rank: which parameters got a gradient anywhere, whether any
    # rank ran a backward that reached a parameter, and whether any rank saw inf/nan. They used to take
    # an all-reduce of their own in finish(), after the end-of-backward one: one more point per step
    # where every rank waits for the slowest. On a small model that wait was 3-5% of the step against
    # DDP's one all-reduce (2 ranks, 500 tensors: benchmarks/results/2026-11-26-idioms-flags.md).
    # Nothing between the end of the last backward and step() changes them, except user code
    # replacing p.grad (reconcile: None clears a parameter's gradient, a tensor gives it one). So the
    # end-of-backward all-reduce carries the three answers too, and finish() takes them from there,
    # with this rank's replacements since then applied on top (the inf/nan answer per parameter, from the
    # norms that all-reduce sums: Note [A replaced gradient brings its own inf]): for a loop that does the same on every
    # rank, as DDP requires, that is exactly what a second all-reduce (MAX over ranks) would give. Each
    # rank decides alone, and every rank decides the same (no collective can go missing on one rank):
    # every step's end_backward() all-reduces, also on a rank with no backward (finish() calls it),
    # and zero_grad forgets the answers on every rank. A loop that replaces p.grad on some ranks only
    # (DDP's replicas would drift apart) gets each rank's own view of those parameters, where the
    # second all-reduce gave their union; the other parameters are unaffected. With gradients on a
    # device the flags still take finish()'s all-reduce: reading "saw inf/nan" at the end of backward
    # would add a host synchronisation there (Note [Norms live with the gradients] in sharded_grad.py).
    def end_backward(self, reached: bool = True) -> None:
        """End of a backward pass (or, reached=False, a rank that had none): reduce what is left."""
        engine = self.require_engine()
        if not self.full_grads:
            # Gradients accumulated under no_sync for parameters this backward did not reach.
            for i in engine.unready_params():
                p = self.params[i]
                if p.grad is not None and not isinstance(p.grad, ShardedGrad):
                    engine.mark_ready(i, p.grad)
                    p.grad = None
        t0 = time.perf_counter()
        engine.flush()
        self.phase["reduce"] += time.perf_counter() - t0
        self.backwards += 1
        # The gradients now live in the shard (Note [Sharded p.grad]). As with DDP, a parameter
        # has one if some rank's backward reached it (or it had one before); the others keep None.
        # The same all-reduce gives every parameter's 2-norm, so reading one needs no collective.
        # Over every rank: replicas hold equal shards, so their squared norms count R times.
        n = len(self.params)
        had, squares = self.had_grad().double(), self.shard.local_square_norms()
        several = dist.get_world_size(self.world_group) > 1
        self.flags_at_end = None
        self.replaced_since.clear()
        if squares.device == had.device:  # gradients on the host: one all-reduce for all
            used = (engine.used().bool() | self.shard.kept).double()
            # With offload the shard is on the host and the engine's inf/nan flag on the gradients' device.
            tail = torch.cat([torch.tensor([float(reached)], dtype=torch.float64),
                              engine.found_nonfinite().reshape(1).to(had.device, torch.float64)])
            stats = torch.cat([had, squares, used, tail])
            if several:
                comm.all_reduce(stats, self.world_group,
                                "end-of-backward (which parameters have gradients, their norms, the step's flags)")
            had, squares = stats[:n], stats[n:2 * n]
            reached_any, found = (stats[3 * n:] > 0).tolist()
            # A parameter's summed squares are inf/nan exactly when some rank's pieces of it are (float64
            # squares of the master dtype's values do not overflow): which gradient holds the inf, for free.
            self.flags_at_end = (stats[2 * n:3 * n] > 0, reached_any, found, ~torch.isfinite(squares),
                                 torch.isnan(squares))
        elif several:
            # Note [Norms live with the gradients] in sharded_grad.py: the flags are read here, the norms are not.
            comm.all_reduce(squares, self.world_group, "end-of-backward (the gradients' norms)")
            comm.all_reduce(had, self.world_group, "end-of-backward (which parameters have gradients)")
        self.shard.set_norms(2.0, (squares / self.replicas).sqrt())
        self.shard.forget_clamps()  # the gradients' inf/nan are known afresh
        has = (had > 0).tolist()
        self.handles_out = True
        if all(has):  # the usual case: every parameter has a gradient
            grads = list(self.shard.handles)
        else:
            # Without one: stage 1 None (not the zeroed view: DDP's p.grad is None here too); stage 2 as is.
            keep = [None] * n if self.full_grads else list(map(_GRAD, self.params))
            grads = [h if x else k for h, x, k in zip(self.shard.handles, has, keep)]
        _ext._C.set_grads(self.params, grads)  # one C++ pass, not n Python assignments
        self.installed = grads

    def reconcile(self) -> None:
        """Takes in replacements of a reduced p.grad by user code (Note [Sharded p.grad]).

        None (nn.Module.zero_grad): the parameter's gradient is cleared, and it
        no longer counts as having one. A tensor: it becomes the gradient.
        """
        if not self.handles_out or all(map(operator.is_, map(_GRAD, self.params), self.installed)):
            return  # nothing installed, or nothing replaced (C loops)
        cleared = []
        for i, p in enumerate(self.params):
            handle = self.installed[i]
            if not isinstance(handle, ShardedGrad) or p.grad is handle:
                continue
            if p.grad is None:
                cleared.append(i)
                self.installed[i] = None
                self.replaced_since[i] = (False, False)
            else:
                # Gradients on the host, or flags already taken this step: whether it holds inf/nan is read
                # here, for finish() (Note [A replaced gradient brings its own inf], Note [A gradient replaced
                # after the flags were taken]); else, on a device, the flag is recomputed below.
                bad = (self.flags_at_end is not None or self.global_used is not None) and \
                    bool((~torch.isfinite(p.grad)).any())
                self.shard.assign(i, p.grad)
                self.engine.note_used(i)
                p.grad = handle
                self.replaced_since[i] = (True, bad)
        if cleared and not any(isinstance(h, ShardedGrad) for h in self.installed):
            # model.zero_grad(): every gradient there was is cleared (parameters that got none, unused or on
            # a branch not taken, had nothing to clear): the same as opt.zero_grad(), the inf/nan flag of a
            # skipped step included (Note [A cleared gradient forgets its inf]).
            self.zero(set_to_none=True)
            return
        if cleared:
            used = self.engine.used()  # the engine's own flags: cleared in place
            self.shard.zero(cleared)
            idx = torch.tensor(cleared, dtype=torch.long)
            used[idx] = 0
            self.last_used[idx] = False
            self.shard.kept[idx] = False
        # Note [A cleared gradient forgets its inf]
        # The engine's inf/nan flag is set while gradients are reduced and cleared by zero_grad. After a
        # skipped step (fp16 loss scaling) the gradients still hold the inf/nan; if user code then clears
        # them, the flag must go too, or every later step is skipped as well (seen: fp16, model.zero_grad()
        # and one parameter without a gradient, skipping every step after the first overflow). Where only
        # some are cleared, what is kept may still hold one: the flag becomes whether this rank's shard does
        # (the reduced inf/nan lands in the shard of the rank that owns it; finish() takes the max over
        # ranks). No host read: the flag stays a tensor.
        # Note [A replaced gradient brings its own inf]
        # The same holds the other way: a tensor the user puts in p.grad between backward and step may hold
        # inf/nan, and the step must see it (skip under loss scaling, raise under nonfinite='raise'), not
        # write it into the weights (seen: every weight inf after one such step, every later step skipped).
        # Here the engine's flag is recomputed from the shard after any replacement; with gradients on the
        # host, finish() takes the answer from the end-of-backward norms and the replacements instead
        # (Note [The step's flags ride the end of backward]).
        self._found_from_shard()

    def _found_from_shard(self) -> None:
        """The engine's inf/nan flag becomes whether this rank's shard holds one now (a tensor op, no host read)."""
        found = self.engine.found_nonfinite()
        found.copy_((~torch.isfinite(self.shard_grad)).any().to(found.device, found.dtype).reshape(found.shape))

    # ----------------------------------------------------------------- step
    def finish(self, at_step=None) -> torch.Tensor:
        """Makes sure gradients are reduced and returns the global "got a gradient" flags. `at_step()` runs
        once this rank has joined every reduction of its peers' backwards, before the flags' own all-reduce
        (stage 3's pass agreement: Note [Passes every rank agrees on] in zero3/passes.py)."""
        if self.global_used is not None:  # taken earlier this step (opt.clip_grad_norm, a norm read)
            if self.handles_out:
                self._take_late_replacements()
            if self.global_used is not None:
                return self.global_used
        engine = self.require_engine()
        self.reconcile()
        if self.backwards == 0:
            # This rank ran no backward that reached a parameter; its peers may
            # have, and wait for its share of every bucket: reduce zeros.
            self.end_backward(reached=False)
            self.backwards = 0
        if at_step is not None:
            at_step()
        if self.flags_at_end is not None:  # Note [The step's flags ride the end of backward]
            used, reached, found = self._flags_from_end()
        else:  # gradients on a device: one small all-reduce of the flags
            if self.clamp_clears_inf and self.shard.clamped_any:  # Note [A clamped gradient loses its inf]
                self._found_from_shard()
            local = engine.used().bool() | self.shard.kept
            flags = torch.cat([local.to(torch.int32), torch.tensor([self.backwards], dtype=torch.int32),
                               engine.found_nonfinite().cpu().to(torch.int32)])
            if dist.get_world_size(self.world_group) > 1:
                comm.all_reduce(flags, self.world_group, "gradient flags", op=dist.ReduceOp.MAX)
            used, (reached, found) = flags[:-2].bool(), flags[-2:].tolist()
        if not reached:
            raise RuntimeError("step() or clip_grad_norm() called before any backward() since the last "
                               "step on every rank: call loss.backward() first")
        self._settle(used, found)
        return self.global_used

    def _flags_from_end(self) -> tuple[torch.Tensor, bool, bool]:
        """(used, reached, found) from the end-of-backward all-reduce, with what changed since on top."""
        # Note [A clamped gradient loses its inf]
        # Under DDP an inf gradient that clip_grad_value_ clamps becomes the bound, and the step uses it; a
        # nan stays nan. Here the step's inf/nan answer came from the end of backward, so such a step was
        # refused (nonfinite='raise', the default for fp32/bf16: FloatingPointError) or skipped ('skip')
        # where DDP trains on. So, without loss scaling, a parameter clamped from both sides by finite
        # bounds since its last backward counts as nonfinite only if it holds a nan: the end-of-backward
        # sums of squares say which do (inf squared is inf, never nan), with no collective. One-sided clamps
        # keep the answer as it was. With loss scaling an inf means the scale overflowed and the step is
        # skipped, as GradScaler decides at unscale_, before any clip.
        used, reached, found, bad, nan = self.flags_at_end
        if found and self.clamp_clears_inf and self.shard.clamped_any:  # Note [A clamped gradient loses its inf]
            bad = torch.where(self.shard.clamped.all(dim=1), nan, bad)
            found = bool(bad.any())
        if self.replaced_since:
            idx = list(self.replaced_since)
            now = torch.tensor(list(self.replaced_since.values()))  # (has a gradient, holds inf/nan)
            used, bad = used.clone(), bad.clone()
            used[idx], bad[idx] = now[:, 0], now[:, 1]
            found = bool(bad.any())  # Note [A replaced gradient brings its own inf]
        return used, reached, found

    # Note [A gradient replaced after the flags were taken]
    # finish() runs once per step; opt.clip_grad_norm (the HF Trainer's clip) calls it before step(). Code
    # that replaces p.grad between that clip and step() (clears a parameter's gradient, assigns a tensor) was
    # not looked at again, so the step used the gradients from before the replacement (seen: l2's gradient
    # cleared after the clip, stepped anyway; DDP does not step it). So a later finish() reconciles again and
    # settles the flags anew: from the end-of-backward answers with gradients on the host (exact, no
    # collective), and on a device on top of the flags already agreed (no second collective: a parameter
    # cleared then counts as without a gradient, a tensor with inf/nan sets the inf flag, a cleared inf keeps
    # it). Clearing every gradient after the clip leaves no gradient to step, as at the start of a step.
    def _take_late_replacements(self) -> None:
        before = dict(self.replaced_since)
        self.reconcile()
        if self.global_used is None:  # every gradient cleared (reconcile called zero()): as a fresh step
            return
        late = {i: v for i, v in self.replaced_since.items() if before.get(i) != v}
        if not late:
            return
        if self.flags_at_end is not None:
            used, _, found = self._flags_from_end()
        else:
            used = self.global_used.clone()
            used[list(late)] = torch.tensor([has for has, _ in late.values()])
            found = self.found_nonfinite or any(bad for _, bad in late.values())
        self._settle(used, found)

    def _settle(self, used: torch.Tensor, found: bool) -> None:
        """The step's global flags; raises on inf/nan where nonfinite says so."""
        self.global_used = used
        self.last_used |= used
        self.found_nonfinite = bool(found)
        # Note [GradScaler owns the inf]
        # nonfinite="raise" (fp32 and bf16 models) stops a diverged run. Under torch.amp.GradScaler an
        # inf/nan is how a too-large scale shows: once scaler.unscale_(opt) went over these gradients (its
        # found_inf then makes scaler.step skip opt.step), a clip in between, opt.clip_grad_norm as much as
        # torch's, returns the inf/nan norm as it does under DDP instead of raising.
        if self.found_nonfinite and self.nonfinite == "raise" and not self.shard.unscaled_by_amp:
            raise FloatingPointError(
                "gradients hold inf or nan on at least one rank (every rank raises this). The model has "
                "probably diverged: lower the learning rate, clip gradients (max_grad_norm=...), or check "
                "the data. To skip such steps instead, pass nonfinite='skip' to ShardedOptimizer "
                "(fp16 models skip by default, with loss scaling).")

    def end_step(self) -> None:
        self.shard.forget_step_marks()
        self.backwards = 0
        self.global_used = None
        self.found_nonfinite = False
        self.flags_at_end = None
        self.replaced_since.clear()

    def zero(self, set_to_none: bool) -> None:
        """Forgets accumulated gradients: the engine's, the shard's and every managed p.grad."""
        self.shard.forget_step_marks()
        if not set_to_none and self.engine is not None:
            self.reconcile()
            self.shard.kept |= self.had_grad()
        if self.engine is not None:
            self.engine.zero_grad()
        if not set_to_none:
            self.shard_grad.zero_()  # the ShardedGrads left in p.grad read zeros
            self.shard.set_norms(2.0, torch.zeros(len(self.params), dtype=torch.float64, device=self.shard.device))
        else:
            self.shard.kept.zero_()
            self.last_used.zero_()
            self.handles_out = False
        # Stage 1: the view autograd accumulates into (zeroed by the engine).
        fresh = list(self.resting)
        if not set_to_none:  # the ShardedGrads stay (reading zeros)
            fresh = [g if isinstance(g, ShardedGrad) else f for g, f in zip(map(_GRAD, self.params), fresh)]
        _ext._C.set_grads(self.params, fresh)
        self.installed = fresh
        self.backwards = 0
        self.global_used = None
        self.flags_at_end = None
        self.replaced_since.clear()
