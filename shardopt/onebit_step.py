"""OneBitAdam's compression-stage step (OneBitStep) and the check that its variance had settled when it froze.

The exchange and the format it runs are onebit.py's (Note [1-bit Adam under ZeRO] there).

Note [Is the variance settled at the freeze]
--------------------------------------------
1-bit Adam assumes Adam's variance has settled by freeze_step: where AdamW's denominator would go on moving
by a factor, OneBitAdam's steps differ from AdamW's by it. The warm-up sums the raw v over the shard at
steps of its last quarter (probe_steps, so that a resume there still has one), T0 and the freeze T. As
v(T) = b2^(T-T0) v(T0) + (1-b2) sum_{T0<k<=T} b2^(T-k) g_k^2, the last quarter's mean square gradient is
S_recent = (V(T) - b2^(T-T0) V(T0)) / (1 - b2^(T-T0)), the frozen variance V(T) / (1 - b2^T). The square
root of their ratio is the growth; beyond GROWTH_WARN (a judgement from benchmarks/onebit_suite.py) a
warning names a later freeze_step. A freeze in the first few steps is not caught.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from shardopt import _ext
from shardopt.onebit import OneBitConfig, allreduce_1bit, decode, message_bytes, residual_numel
from shardopt.onebit_sketch import sketch, sketch_at
from shardopt.parallel import comm as _comm

GROWTH_WARN = 2.0  # warn when the growth is above this or below its inverse


def variance_growth(sums: dict, frozen_at: int, beta2: float) -> float | None:
    """sqrt(S_recent / v_hat(T)) from `sums` (step -> the sum of the raw v at that step), T = frozen_at, T0
    the first recorded step >= T - T // 4 before T; None without both records."""
    if frozen_at not in sums:
        return None
    earlier = [s for s in sums if frozen_at - max(1, frozen_at // 4) <= s < frozen_at]
    if not earlier:
        return None
    t0 = min(earlier)
    decay = beta2 ** (frozen_at - t0)
    recent = (sums[frozen_at] - decay * sums[t0]) / (1.0 - decay)
    frozen = sums[frozen_at] / (1.0 - beta2 ** frozen_at)
    if frozen <= 0:
        return None
    return math.sqrt(max(recent, 0.0) / frozen)


def probe_steps(freeze_step: int) -> tuple[int, int]:
    """(first, every): the warm-up sums v at steps first, first + every, ... up to freeze_step, and at it."""
    return freeze_step - max(1, freeze_step // 4), max(1, freeze_step // 16)


def _kernel_freezes() -> bool:
    """Whether the built CPU Adam kernel takes beta2 = 1 (a frozen variance); else foreach ops step."""
    global _KERNEL_FREEZES
    if _KERNEL_FREEZES is None:
        from shardopt.cpu_adam import fused_adam_step
        t = [torch.ones(1)]
        try:
            fused_adam_step(t, [torch.ones(1)], [torch.zeros(1)], [torch.ones(1)], lr=0.0, beta1=0.0, beta2=1.0,
                            eps=1e-8, weight_decay=0.0, adamw=True, step=1, bias_correction=False)
            _KERNEL_FREEZES = True
        except RuntimeError:
            _KERNEL_FREEZES = False
    return _KERNEL_FREEZES


_KERNEL_FREEZES = None


class OneBitStep:
    """OneBitAdam's compression-stage step and its state, beside master_step.MasterStep in ShardedOptimizer;
    it reads the optimizer through `opt.view` (Note [The optimizer's view] in view.py)."""

    def __init__(self, opt, config: OneBitConfig):
        self.opt = opt
        self.config = config
        betas = {tuple(g["betas"]) for g in opt.param_groups}
        if len(betas) != 1:
            raise ValueError(f"OneBitAdam needs the same betas in every parameter group (the momentum is "
                             f"exchanged as one flat shard), got {sorted(betas)}")
        self.beta1, self.beta2 = next(iter(betas))
        layout = opt.layout
        self.rank, self.world = opt.rank, opt.world_size
        self.replicas = opt.sharding.shape.replicas
        self.n = layout.shard_numel()
        offsets = layout.chunk_offsets()
        self.piece_at = [offsets[pc.bucket] + pc.start - layout.buckets[pc.bucket].chunk(self.rank)[0]
                         for pc in opt.view.pieces]
        backend = str(dist.get_backend(opt.world_group))
        if self.world > 1 and _comm.reduces_on_device(backend, "cpu"):
            raise ValueError(
                f"OneBitAdam exchanges its 1-bit messages as CPU tensors, and this process group "
                f"({backend}) has no CPU backend: initialise it with "
                f"init_process_group(backend=\"cpu:gloo,cuda:nccl\") (never tried on GPUs), or train with "
                f"optim=torch.optim.AdamW")
        if opt.config.inter_node_dtype is not None:
            raise ValueError("OneBitAdam brings its own compression of the inter-node hop (1-bit, from freeze_step "
                             "on; exact during the warm-up): drop inter_node_dtype")
        # Residuals and local momentum, laid out as residual_numel says (Note [Hop residual in checkpoints]).
        self.steps = 0
        self.residual = torch.zeros(residual_numel(self.n, self.world, self.replicas, config.block),
                                    dtype=torch.float32)
        w, n = self.world, self.n
        if self.residual.numel():
            sent = w * n if self.replicas == 1 else n
            at = sent + (n if self.replicas == 1 else n // self.replicas)
            self.worker, self.server = self.residual[:sent], self.residual[sent:at]
            self.known = self.residual[at:at + 1]
            self.local_m = self.residual[at + 1:]
        self.started_at = None  # the step at which compression started in this run
        self.frozen_at = None  # Note [The step the variance froze at] in onebit.py
        self.variance_sums = {}  # warm-up step -> this rank's sum of v (Note [Is the variance settled at the freeze])
        self.growth = None
        self.m = self.v = self.denom = self.denom_rows = None
        self.ranges = None  # this rank's chunks in the flat layout (the hybrid mesh's sketch)
        self._local = None  # this step's local gradient, fp32 [total]
        self._flagged = None  # this step's (used, skip)
        self._coef = 1.0  # this step's clipping coefficient, applied before the exchange

    @property
    def compressing(self) -> bool:
        return self.steps >= self.config.freeze_step

    def local_grads(self) -> bool:
        """Whether backward keeps gradients local: the flat mesh's compression stage exchanges them at step()."""
        return self.compressing and self.replicas == 1

    def after_warmup_step(self, skipped: bool) -> None:
        if not skipped:
            self.steps += 1
            self._probe_variance()
            self.sync_engine()

    def _probe_variance(self) -> None:
        """Note [Is the variance settled at the freeze]: the sum of this rank's v at probe_steps."""
        first, every = probe_steps(self.config.freeze_step)
        t = self.steps
        if t > self.config.freeze_step or t < first or (t != self.config.freeze_step and (t - first) % every):
            return
        inner, total = self.opt.inner, 0.0
        if inner is not None:
            for p in self.opt.view.piece_params:
                st = inner.state.get(p)
                if st and "exp_avg_sq" in st:
                    total += float(st["exp_avg_sq"].sum(dtype=torch.float64))
        self.variance_sums[t] = total

    def sync_engine(self) -> None:
        """Hybrid mesh: the bucket engine's hop across replicas runs in warm-up, off once compressing."""
        engine = self.opt.engine
        if engine is not None and self.replicas > 1:
            engine.set_replica_hop(not self.compressing)

    def _local_grad(self) -> torch.Tensor:
        """This rank's gradient over the flat layout, fp32 and unscaled (cached for the step)."""
        if self._local is not None:
            return self._local
        opt = self.opt
        layout = opt.layout
        flat = opt.store.flat_grad
        if flat is not None and flat.dtype == torch.float32 and flat.device.type == "cpu" \
                and opt.loss_scaler is None and flat.numel() == layout.total_numel:
            self._local = flat  # read only
            return flat
        g = torch.zeros(layout.total_numel, dtype=torch.float32)
        if flat is not None:
            g.copy_(flat)
        else:
            grads = [(slot, p.grad) for slot, p in zip(layout.params, opt.view.params) if p.grad is not None]
            devices = {grad.device for _, grad in grads}
            # Gradients on a GPU are laid out there and brought over in one copy: a copy per parameter is a
            # host sync each (54 syncs per step for the demo GPT on an H100, against 3).
            staged = g if devices <= {torch.device("cpu")} or len(devices) > 1 else \
                torch.zeros(layout.total_numel, dtype=torch.float32, device=next(iter(devices)))
            for slot, grad in grads:
                staged[slot.offset:slot.end].copy_(grad.detach().reshape(-1))
            if staged is not g:
                g.copy_(staged)
        if opt.loss_scaler is not None:
            g.div_(opt.loss_scaler.scale)
        self._local = g
        return g

    def _flags(self):
        """(used per parameter anywhere, some rank saw inf/nan): one all-reduce over the world."""
        opt = self.opt
        g = self._local_grad()
        used = torch.tensor([p.grad is not None for p in opt.view.params], dtype=torch.int32)
        if opt.engine is not None:
            used |= opt.engine.used().to(torch.int32)
        # inf/nan anywhere makes the sum inf/nan: one pass, no mask (a sum beyond fp32's range skips too)
        flags = torch.cat([used, torch.tensor([0 if torch.isfinite(g.sum()) else 1], dtype=torch.int32)])
        if dist.get_world_size(opt.world_group) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=opt.world_group)
        return flags[:-1].bool(), bool(flags[-1])

    def _checked(self):
        """This step's (used, skip), once: clip_grad_norm and step share it."""
        if self._flagged is None:
            if self.replicas == 1:
                self._flagged = self._flags()
            else:  # reduced in the shard group by the engine: its flags, as in warm-up
                used = self.opt.view.finish_grads()
                self._flagged = (used, self.opt.grads.found_nonfinite)
            if not self._flagged[1] and self.m is None:
                self._start()
        return self._flagged

    def _local_momentum(self) -> torch.Tensor:
        """This rank's local momentum (flat: [W, n]; hybrid: [n]), set from the owners' m at the first
        compression step and after the residuals restart."""
        if float(self.known[0]) != 1.0:
            if self.replicas > 1:
                self.local_m.copy_(self.m.float().cpu())
            else:
                _comm.start_all_gather(self.m.float().cpu().contiguous(), self.local_m, self.opt.process_group).wait()
            self.known.fill_(1.0)
        return self.local_m if self.replicas > 1 else self.local_m.view(self.world, self.n)

    def _exchange(self) -> torch.Tensor:
        """This step's momentum on this rank's shard (fp32, CPU), exchanged (Note [1-bit Adam under ZeRO])."""
        if self.replicas > 1:
            return self._exchange_replicas()
        opt, b1 = self.opt, self.beta1
        rows, a = self._rows(self._local_grad()), (1.0 - b1) * self._coef
        if self.world == 1:  # nothing to exchange
            return self.m.float().cpu().mul(b1).add_(rows[0].mul_(a))  # out of place: .float().cpu() may be self.m
        # Note [The local momentum in one pass] in csrc/comm/onebit_codec.h
        local = self._local_momentum()
        x = torch.empty_like(local)
        _ext._C.onebit_local_momentum(rows.view(-1), local.view(-1), self.denom_rows.view(-1), a, b1, x.view(-1))
        x[self.padding_rows] = 0.0
        msgs = allreduce_1bit(x.view(-1), opt.process_group, self.rank, self.worker, self.server, self.config.block,
                              self.config.scale, self.config.gains)
        return decode(msgs[self.rank:self.rank + 1], self.n, self.config.block, times=self.denom.view(1, -1))[0]

    def _exchange_replicas(self) -> torch.Tensor:
        """Hybrid mesh: the replicas' mean momentum (or increment) over the shard group's exact mean gradient."""
        opt, b1 = self.opt, self.beta1
        group, replica = opt.sharding.replicate, opt.sharding.replica
        a, per = (1.0 - b1) * self._coef, self.n // self.replicas
        if self.config.hybrid_exchange == "momentum":
            grad = opt.shard_grad.float().cpu().reshape(-1)  # read only (it may be shard_grad itself)
            local, x = self._local_momentum(), torch.empty(self.n, dtype=torch.float32)
            _ext._C.onebit_local_momentum(grad, local, self.denom, a, b1, x)
            msgs = allreduce_1bit(x, group, replica, self.worker, self.server, self.config.block,
                                  self.config.scale, self.config.gains)
            return decode(msgs, per, self.config.block, times=self.denom.view(self.replicas, per)).reshape(-1)
        # out of place: .float().cpu() may be shard_grad itself
        x = opt.shard_grad.float().cpu().mul(a)
        m = self.m.float().cpu()
        msgs = allreduce_1bit(x.div_(self.denom), group, replica, self.worker, self.server, self.config.block,
                              self.config.scale, self.config.gains)
        return decode(msgs, per, self.config.block, times=self.denom.view(self.replicas, per)).reshape(-1).add_(m, alpha=b1)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The mean gradient's norm, estimated (Note [Clipping by a sketch] in onebit_sketch.py), as already
        clipped; step() applies the coefficient to every local gradient before the exchange."""
        if float(norm_type) != 2.0:
            raise NotImplementedError("in OneBitAdam's compression stage only the 2-norm can be clipped")
        _, skip = self._checked()
        if skip:
            return torch.tensor(float("nan"))
        if self.replicas == 1:  # every rank's local gradient: their sum over the world
            sums, count = sketch(self._local_grad()), dist.get_world_size(self.opt.world_group)
        else:  # every shard group's mean, as shards: their sum over the world is R times the mean's
            shard = self.opt.shard_grad.float().cpu()
            sums, count = sketch_at(shard, self.ranges, self.opt.layout.total_numel), self.replicas
        if dist.get_world_size(self.opt.world_group) > 1:
            dist.all_reduce(sums, group=self.opt.world_group)
        total = (sums.double().square().sum().sqrt() / count).float()
        total = total * self._coef
        self._coef *= min(1.0, float(max_norm) / (float(total) + 1e-6))
        return total

    def _start(self) -> None:
        """First compression step: m and the frozen v as flat shards, the inner optimizer's state tensors
        views of them (where checkpoints read them); d; the warnings of the freeze."""
        opt = self.opt
        inner = opt.inner
        if self.ranges is None:
            self.ranges = [b.chunk(self.rank) for b in opt.layout.buckets]
        self.m = torch.zeros(self.n, dtype=torch.float32, device=opt.master_device)
        self.v = torch.zeros(self.n, dtype=torch.float32, device=opt.master_device)
        for at, t in zip(self.piece_at, opt.view.piece_params):
            st = inner.state.get(t) if inner is not None else None
            if not st or "exp_avg" not in st:
                if inner is not None and t.numel():
                    inner.state[t] = {"step": torch.tensor(float(self.steps)),
                                      "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
                    st = inner.state[t]
                else:
                    continue
            self.m[at:at + t.numel()].copy_(st["exp_avg"].reshape(-1))
            self.v[at:at + t.numel()].copy_(st["exp_avg_sq"].reshape(-1))
            st["exp_avg"] = self.m[at:at + t.numel()].view_as(t)
            st["exp_avg_sq"] = self.v[at:at + t.numel()].view_as(t)
        # Bucket padding keeps m = 0: decoded noise there is in no checkpoint, and a resume would differ.
        covered = torch.zeros(self.n, dtype=torch.bool)
        for at, t in zip(self.piece_at, opt.view.piece_params):
            covered[at:at + t.numel()] = True
        self.padding = (~covered).nonzero().reshape(-1)
        if self.replicas == 1 and self.world > 1:  # every chunk's padding: no momentum crosses there
            flat = torch.ones(opt.layout.total_numel, dtype=torch.bool)
            for slot in opt.layout.params:
                flat[slot.offset:slot.end] = False
            self.padding_rows = self._rows(flat)
        # d = sqrt(v) / sqrt(bc2(T)) + eps, eps per element from its bucket's parameter group
        layout, offsets = opt.layout, opt.layout.chunk_offsets()
        eps = torch.empty(self.n, dtype=torch.float32)
        for b, at in zip(layout.buckets, offsets):
            eps[at:at + b.chunk_numel].fill_(float(opt.param_groups[b.group]["eps"]))
        if self.frozen_at is None:
            self.frozen_at = self.steps
        bc2 = 1.0 - self.beta2 ** self.frozen_at
        self.denom = self.v.float().cpu().sqrt().div_(math.sqrt(bc2)).add_(eps)  # eps is read here, at the freeze
        del eps
        self.denom_master = self.denom.to(opt.master_device)  # the same tensor on a CPU master
        if self.replicas == 1 and self.world > 1:  # every rank sends to every owner: each owner's d
            rows = torch.empty(self.world * self.n, dtype=torch.float32)
            _comm.start_all_gather(self.denom, rows, opt.process_group).wait()
            self.denom_rows = rows.view(self.world, self.n)
        else:
            self.denom_rows = self.denom.view(1, -1)
        if self.started_at is None:
            self.started_at = self.steps + 1
            # Note [Zero variance at the freeze]: an element with no gradient in the whole warm-up (an
            # embedding row of a token not yet seen) freezes v = 0, so d = eps: once it gets a gradient its
            # step is lr * m / eps, and its block's 1-bit scale with it. Counted here, said once.
            zero = torch.tensor([int(((self.v == 0).cpu() & covered).sum())], dtype=torch.int64)
            t = self.frozen_at
            first = min((s for s in self.variance_sums if t - max(1, t // 4) <= s < t), default=None)
            probed = first is not None and t in self.variance_sums
            sums = torch.tensor([self.variance_sums[first], self.variance_sums[t]] if probed else [0.0, 0.0],
                                dtype=torch.float64)
            if self.world > 1:
                dist.all_reduce(zero, group=opt.process_group)  # replicas hold the same shards
                dist.all_reduce(sums, group=opt.process_group)
            self.growth = variance_growth({first: float(sums[0]), t: float(sums[1])}, t, self.beta2) \
                if probed else None
            self.variance_sums = {}
            total = sum(slot.numel for slot in opt.layout.params)
            if dist.get_rank(opt.world_group) == 0:
                warnings.warn(f"OneBitAdam: variance frozen after {self.frozen_at} steps; 1-bit "
                              f"momentum exchange from step {self.started_at}", UserWarning, stacklevel=4)
                if int(zero):
                    warnings.warn(
                        f"OneBitAdam: {int(zero):,} of {total:,} parameters ({int(zero) / total:.1%}) had a zero "
                        f"gradient in all {self.frozen_at} warm-up steps, so their variance froze at 0: "
                        f"if they get a gradient later, their step is lr * momentum / eps and the loss can blow up "
                        f"(typically embedding rows of tokens the warm-up never saw). Freeze later (freeze_step) "
                        f"or freeze parameters that never train.", UserWarning, stacklevel=4)
                if self.growth is not None and not 1 / GROWTH_WARN <= self.growth <= GROWTH_WARN:
                    warnings.warn(
                        f"OneBitAdam: Adam's variance was still moving when it froze after {t} steps: over the last "
                        f"quarter of the warm-up (from step {first}) the gradients' RMS was {self.growth:.2f}x the "
                        f"frozen denominator's: Adam's own denominator would go on moving toward it, the frozen one "
                        f"does not (1-bit Adam assumes a settled variance). Try a later freeze, e.g. "
                        f"freeze_step={2 * t}, "
                        f"and check the loss against AdamW's (Note [Is the variance settled at the freeze]).",
                        UserWarning, stacklevel=4)

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[total] -> [W, n]: row r is rank r's chunk of every bucket (Bucket.chunk(r): Note [Node-aware chunk
        order] in layout.py). One cat per row copies each chunk once; a cat of [W, -1] views then reordered
        would pass over the model twice (a fifth of a flat step)."""
        rows = torch.empty(self.world, self.n, dtype=flat.dtype)
        for r in range(self.world):
            torch.cat([flat[slice(*b.chunk(r))] for b in self.opt.layout.buckets], out=rows[r])
        return rows

    @torch.no_grad()
    def step(self) -> bool:
        """One compression-stage step on every rank; returns True if it was skipped (inf/nan)."""
        opt = self.opt
        try:
            used, skip = self._checked()
            if skip:
                return True
            if opt.config.max_grad_norm is not None:
                self.clip_grad_norm(opt.config.max_grad_norm)
            new_m = self._exchange().to(self.m.device)
            if self.padding.numel():
                new_m[self.padding] = 0.0
            self._apply(new_m, used)
            self.steps += 1
            return False
        finally:
            self._local = None
            self._flagged = None
            self._coef = 1.0

    def _apply(self, new_m: torch.Tensor, used: torch.Tensor) -> None:
        """m takes the exchanged values and the shard steps with the frozen variance (used pieces only)."""
        opt = self.opt
        inner = opt.inner
        used = used.tolist()
        if all(used):
            self.m.copy_(new_m)
        t = self.steps + 1
        bc1 = 1.0 - self.beta1 ** t
        bc2 = 1.0 - self.beta2 ** self.frozen_at
        pieces = opt.view.pieces
        for g, group in zip(inner.param_groups if inner is not None else [], opt.param_groups):
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            ps, ms, vs, ds, gs = [], [], [], [], []
            for p in g["params"]:
                k = self._piece_index[id(p)]
                pc, at = pieces[k], self.piece_at[k]
                if not used[pc.param] or not p.numel():
                    continue
                m = self.m[at:at + p.numel()]
                if not all(used):
                    m.copy_(new_m[at:at + p.numel()])
                inner.state[p]["step"] += 1
                ps.append(p.view(-1))
                ms.append(m)
                gs.append(new_m[at:at + p.numel()])
                vs.append(self.v[at:at + p.numel()])
                ds.append(self.denom_master[at:at + p.numel()])
            if not ps:
                continue
            if opt.config.offload == "cpu" and _kernel_freezes():
                # beta1 = 0 (exp_avg = the exchanged m), beta2 = 1 (v unchanged), bias corrections folded in:
                # (lr s / bc1) m / (sqrt(v) + eps s) = lr / bc1 * m / (sqrt(v) / s + eps), s = sqrt(bc2(T)).
                from shardopt.cpu_adam import fused_adam_step
                s = math.sqrt(bc2)
                fused_adam_step(ps, gs, ms, vs, lr=lr * s / bc1, beta1=0.0, beta2=1.0,
                                eps=eps * s, weight_decay=wd * bc1 / s, adamw=True, step=t, bias_correction=False)
                continue
            if wd != 0:
                torch._foreach_mul_(ps, 1.0 - lr * wd)
            # d as _start computed it: the same bits as recomputing it here
            torch._foreach_addcdiv_(ps, ms, ds, value=-lr / bc1)

    # The residuals' meaning (hop_residual.signature): a checkpoint of another format restarts them.
    @property
    def format_name(self) -> str:
        c = self.config
        if tuple(c.gains) == (1.0, 1.0):
            return "onebit-local-rms" if c.scale == "rms" else "onebit-local"
        return f"onebit-local-{c.scale}-{c.gains[0]:g}-{c.gains[1]:g}"

    def record(self) -> dict:
        """What a checkpoint keeps of this step's state besides the optimizer state and the residuals."""
        return {"frozen_at": self.frozen_at}

    def after_load(self, record: dict | None, steps: int | None = None) -> None:
        """After a load into the inner optimizer: the steps taken from `steps` or its state (the largest over
        every rank: a collective), m and v re-viewed at the next step, and T (Note [The step the variance froze
        at] in onebit.py) from `record`: a record(), {"legacy": True} for a OneBitAdam checkpoint without one,
        or None for another optimizer's state."""
        opt = self.opt
        if steps is None:
            steps = 0
            if opt.inner is not None:
                for st in opt.inner.state.values():
                    if "step" in st:
                        steps = max(steps, int(float(st["step"])))
            t = torch.tensor([steps], dtype=torch.int64)
            if dist.get_world_size(opt.world_group) > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=opt.world_group)
            steps = int(t.item())
        self.steps = steps
        if record is not None and record.get("legacy"):
            frozen = self.config.freeze_step
        else:
            frozen = record.get("frozen_at") if record is not None else None
        self.frozen_at = frozen if frozen is not None and self.compressing else None
        self.m = self.v = None
        self.started_at = None
        self.variance_sums = {}  # sums from before the load belong to other steps
        self.sync_engine()

    def reset_residual(self) -> None:
        self.residual.zero_()

    @property
    def _piece_index(self) -> dict:
        idx = getattr(self, "_piece_index_cache", None)
        if idx is None:
            idx = self._piece_index_cache = {id(t): k for k, t in enumerate(self.opt.view.piece_params)}
        return idx

    def host_bytes(self) -> int:
        """Host memory of the compression state besides the optimizer's: residuals (and the flat mesh's
        messages) and the frozen denominators."""
        ts = [self.residual, self.denom]
        if self.replicas == 1 and self.world > 1:  # elsewhere denom_rows is a view of denom
            ts.append(self.denom_rows)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def link_bytes_per_step(self) -> dict:
        """The arithmetic of Note [1-bit Adam under ZeRO]: bytes this rank sends per compression step."""
        b = self.config.block
        if self.replicas == 1:  # W-1 rows to their owners, then the owner's message to the W-1 others
            return {"reduce": 2 * (self.world - 1) * message_bytes(self.n, b)}
        part = self.n // self.replicas
        return {"intra": (self.world - 1) * self.n * 4,
                "inter": 2 * (self.replicas - 1) * message_bytes(part, b)}
