"""Gradient sync: the end of each backward, the flags a step needs, and p.grad in between (Note [Sharded p.grad])."""
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
    """The C++ bucket engine for this layout (Note [Bucket engine] in csrc/comm/bucket_engine.h)."""
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
    opts.keep_full_grads = flat_grad.numel() > 0  # reduced from the flat gradient buffer, or from staging
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
        self.zero_shard = shard_grad.zero_  # the shard on disk: its file zeroed without I/O (tiers/grad_shard.py)
        # Per parameter, what .grad holds while autograd accumulates: stage 1 its view of the flat buffer, else None.
        self.resting = resting_grads
        self.full_grads = any(g is not None for g in resting_grads)
        self.shard = grad_shard
        grad_shard.flat = shard_grad  # its pieces are views of it (Note [Foreach over a shard])
        grad_shard.installed = lambda: self.installed  # Note [What a list leaves out] in sharded_grad.py
        self.world_group = world_group
        self.replicas = replicas
        self.nonfinite = nonfinite
        # Note [A clamped gradient loses its inf]: only without loss scaling.
        self.clamp_clears_inf = not loss_scaled
        self.phase = phase
        self.engine = None         # created by ShardedDDP (it knows the model's parameter order)
        self.attached = False      # a live ShardedDDP feeds the engine (Note [Hooks die with the wrapper])
        # What this optimizer last put in each parameter's .grad: its ShardedGrad, its stage-1 view, or None.
        self.installed: list = list(resting_grads)
        self.last_used = torch.zeros(len(params), dtype=torch.bool)  # global, at the last step
        self.handles_out = False   # some installed[i] may be a ShardedGrad (else reconcile has nothing to do)
        self.backwards = 0         # backward passes reduced since the last step
        self.global_used = None    # per parameter: got a gradient on some rank (cached until step)
        self.found_nonfinite = False  # some rank's gradients held inf/nan (valid with global_used)
        # Note [The step's flags ride the end of backward]; None: finish() all-reduces them.
        self.flags_at_end: tuple[torch.Tensor, bool, bool, torch.Tensor, torch.Tensor] | None = None
        self.replaced_since: dict[int, tuple[bool, bool]] = {}
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
    # torch's clip_grad_norm_(model.parameters()) totals the norms in the model's order, not the groups'; another
    # order can change the last bit, which bf16 autocast amplifies past parity. So ShardedDDP hands its order over.
    def order_norms_as(self, order: list[int]) -> None:
        """Parameter indices in the model's order (those it does not list follow in this optimizer's)."""
        seen = set(order)
        self.shard.set_model_order(list(order) + [i for i in range(len(self.params)) if i not in seen])
        self._norm_pick = None

    def norms_in_model_order(self, ord: float) -> torch.Tensor:
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

    def begin_backward(self) -> None:
        """A backward starts: takes in what user code did to p.grad (Note [Sharded p.grad]), then resets p.grad."""
        if not self.handles_out:
            return  # no ShardedGrad was installed since the last zero_grad
        self.reconcile()
        for i, p in enumerate(self.params):
            if isinstance(p.grad, ShardedGrad):
                p.grad = self.installed[i] = self.resting[i]

    # Note [The step's flags ride the end of backward]
    # On the host the end-of-backward all-reduce carries the step's flags (one wait for the slowest rank, not two);
    # finish() applies this rank's p.grad replacements on top. On a device they keep an all-reduce of their own.
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
        # As with DDP a parameter has a gradient if some rank's backward reached it; replicas' squares count R times.
        n = len(self.params)
        had, squares = self.had_grad().double(), self.shard.local_square_norms()
        several = dist.get_world_size(self.world_group) > 1
        self.flags_at_end = None
        self.replaced_since.clear()
        if squares.device == had.device:  # gradients on the host: one all-reduce for all
            used = (engine.used().bool() | self.shard.kept).double()
            tail = torch.cat([torch.tensor([float(reached)], dtype=torch.float64),
                              engine.found_nonfinite().reshape(1).to(had.device, torch.float64)])
            stats = torch.cat([had, squares, used, tail])
            if several:
                comm.all_reduce(stats, self.world_group,
                                "end-of-backward (which parameters have gradients, their norms, the step's flags)")
            had, squares = stats[:n], stats[n:2 * n]
            reached_any, found = (stats[3 * n:] > 0).tolist()
            # Summed float64 squares are inf/nan exactly when some rank's pieces are: which gradient holds one.
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
        """Takes in user code's replacements of a reduced p.grad: None clears it, a tensor becomes it."""
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
                # On the host, or once flags are taken (Note [A gradient replaced after the flags were taken]).
                bad = (self.flags_at_end is not None or self.global_used is not None) and \
                    bool((~torch.isfinite(p.grad)).any())
                self.shard.assign(i, p.grad)
                self.engine.note_used(i)
                p.grad = handle
                self.replaced_since[i] = (True, bad)
        if cleared and not any(isinstance(h, ShardedGrad) for h in self.installed):
            # model.zero_grad(): as opt.zero_grad() (Note [A cleared gradient forgets its inf]).
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
        # After a skipped step, clearing the gradients must clear the inf/nan flag too, or every later step skips.
        # Note [A replaced gradient brings its own inf]
        # A tensor put in p.grad may hold inf/nan: the step must skip or raise, so the flag is recomputed here.
        self._found_from_shard()

    def _found_from_shard(self) -> None:
        """The engine's inf/nan flag becomes whether this rank's shard holds one now (a tensor op, no host read)."""
        found = self.engine.found_nonfinite()
        found.copy_((~torch.isfinite(self.shard_grad)).any().to(found.device, found.dtype).reshape(found.shape))

    def finish(self, at_step=None) -> torch.Tensor:
        """Gradients reduced; returns the global "got a gradient" flags (`at_step()` runs before they are agreed)."""
        if self.global_used is not None:  # taken earlier this step (opt.clip_grad_norm, a norm read)
            if self.handles_out:
                self._take_late_replacements()
            if self.global_used is not None:
                return self.global_used
        engine = self.require_engine()
        self.reconcile()
        if self.backwards == 0:
            # No backward reached a parameter here; peers may wait for this rank's share: reduce zeros.
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
        # Under DDP a clamped inf is the bound: clamped from both sides, only a nan (its squares say) is nonfinite.
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
    # A p.grad replaced between opt.clip_grad_norm (which runs finish()) and step() still counts, as under DDP.
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
        # After scaler.unscale_(opt) an inf/nan is GradScaler's too-large scale (it skips the step): no raise.
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
            self.zero_shard()  # the ShardedGrads left in p.grad read zeros
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
