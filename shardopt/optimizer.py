"""ShardedOptimizer: each rank steps only its chunks (ZeRO 1-3; Note [One parameter store] in param_store.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, _JoinConfig

from shardopt.config import ShardConfig, auto_bucket_size
from shardopt import device_ops as _device_ops
from shardopt import offload as _offload
from shardopt import onebit as _onebit
from shardopt.onebit_step import OneBitStep
from shardopt.elementwise import check_elementwise
from shardopt.flat_params import FlatStore
from shardopt.grad_sync import GradSync, build_engine
from shardopt.join import ShardedJoin
from shardopt.master_step import MasterStep
from shardopt.publish import Publisher
from shardopt.parallel.consistency import check_same_across_ranks
from shardopt.layout import Layout, plan_launch_order
from shardopt.parallel.mesh import require_dist, resolve_groups
from shardopt.parallel.mesh_plan import param_phase_dtype
from shardopt.precision import LossScaler, resolve_loss_scale, resolve_nonfinite
from shardopt.sharded_grad import GradShard
from shardopt.tiers.disk import failed_anywhere, made_everywhere
from shardopt.tiers.grad_shard import MappedShard
from shardopt.view import OptimizerView
from shardopt.zero3.store import ShardedStore

_LOW_PRECISION = (torch.bfloat16, torch.float16)

_VERSION = operator.attrgetter("_version")
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ShardConfig))


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """Drop-in replacement for a torch.optim optimizer that shards its state over ranks: `optim` (elementwise)
    takes the options that are not ShardConfig fields. Use with `ShardedDDP(model, optimizer)`."""

    def __init__(self, params, optim=None, *, process_group=None, mesh=None, shard_group: str | None = None,
                 **options):
        # Each option is a ShardConfig field, declared and documented there once; the rest go to `optim`.
        self.config = ShardConfig(**{k: v for k, v in options.items() if k in _CONFIG_FIELDS})
        optim_kwargs = {k: v for k, v in options.items() if k not in _CONFIG_FIELDS}
        # OneBitAdam: our AdamW path plus its compressed exchange (Note [1-bit Adam under ZeRO] in onebit.py).
        optim, optim_kwargs, onebit_config = _onebit.split_options(optim, optim_kwargs, self.config.offload)
        if onebit_config is not None and self.config.offload == "nvme":
            raise NotImplementedError("OneBitAdam keeps its residuals and frozen variance in host memory and steps "
                                      "them whole: use offload='cpu' with it, not 'nvme'")
        optim, optim_kwargs = _offload.default_optimizer(optim, optim_kwargs, self.config.offload)
        check_elementwise(optim)
        require_dist()  # before any work: the groups are resolved once the parameters are known
        # The inner optimizer's own defaults, validated by constructing it once on a dummy tensor.
        super().__init__(params, dict(optim([torch.zeros(1, requires_grad=True)], **optim_kwargs).defaults))
        self.optim_class = optim
        self._take_params()
        self._resolve_groups(process_group, mesh, shard_group)
        store_class = ShardedStore if self.config.stage == 3 else FlatStore
        self.layout: Layout = self._plan(store_class)
        self._resolve_precision(store_class.holds_whole)
        check_same_across_ranks(
            self.sharding.signature() + self.config.signature()
            + [f"optimizer {optim.__module__}.{optim.__qualname__}", f"dtype {self.dtype}"] + self.layout.signature()
            + [f"group {g} " + repr({k: v for k, v in grp.items() if k != "params"})
               for g, grp in enumerate(self.param_groups)],
            "parameters and optimizer configuration", self.world_group)
        self._phase = dict.fromkeys(("reduce", "step", "publish", "gather"), 0.0)  # see phase_seconds()
        self.store = store_class(self.layout, self.rank, self._params, self.sharding, self.config, self.device,
                                 self._phase)
        self._build_step_parts(optim, optim_kwargs)
        self.view = OptimizerView(self)
        self.engine = None          # created by ShardedDDP (it knows the model's parameter order)
        self.onebit = OneBitStep(self, onebit_config) if onebit_config is not None else None
        if self.state_tier is not None and self.store.tier is not None and self.onebit is None:
            # Note [The step walked in the next forward] in tiers/pending_step.py
            self.stepper.leave_steps_open(self._phase, self.store.tier, self.store.forward_order)
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._join_config = _JoinConfig.construct_disabled_join_config()
        self.join = ShardedJoin(self)

    def _take_params(self) -> None:
        self._params: list[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]
                                                  if p.requires_grad]
        if not self._params:
            raise ValueError("ShardedOptimizer got no parameter that requires grad")
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._check_params()

    def _resolve_groups(self, process_group, mesh, shard_group) -> None:
        """Which ranks shard together (process_group, rank, world_size) and replicate (Note [Hybrid sharding])."""
        where = _device_ops.materialization_device(self._params[0].device)  # a meta model's too
        self.sharding = resolve_groups(process_group, mesh, shard_group, where.type,
                                       node_aware=self.config.node_aware)
        self.process_group = self.sharding.shard
        self.world_group = self.sharding.world
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        if self.sharding.shape.hybrid and where.type != "cpu":
            raise NotImplementedError(
                f"hybrid sharding's inter-node hop runs on CPU tensors (gloo) in this release; the model is on "
                f"{where}. Shard flat (process_group=...) for now.")
        if self.config.inter_node_dtype is not None and not self.sharding.shape.hybrid and self.sharding.nodes is None:
            if mesh is None and shard_group is None:
                raise ValueError("inter_node_dtype compresses the inter-node hop of hybrid sharding or of node-aware "
                                 "flat sharding: pass shard_group='node' or mesh=DeviceMesh((replicate, shard)), or "
                                 "run with ranks on several nodes (LOCAL_WORLD_SIZE < world size), or drop it")
            warnings.warn(f"inter_node_dtype={self.config.inter_node_dtype!r} has no effect: the mesh "
                          f"{self.sharding.shape} has one replica, so no gradient crosses between nodes",
                          UserWarning, stacklevel=3)

    def _plan(self, store_class) -> Layout:
        """The flat layout (Note [Flat layout] in layout.py), cut as the store needs it."""
        names = []
        for g, group in enumerate(self.param_groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            names.append([(f"group{g}.param{i}", tuple(p.shape)) for i, p in enumerate(trainable)])
        total = sum(p.numel() for p in self._params)
        nodes = self.sharding.nodes
        rbs = self.config.reduce_bucket_size if self.config.reduce_bucket_size is not None \
            else auto_bucket_size(total, self.config.stage, across_nodes=nodes is not None)
        agbs = self.config.allgather_bucket_size if self.config.allgather_bucket_size is not None else rbs
        return store_class.plan(names, self.world_size, self.config, (rbs, agbs), self.sharding.shape.replicas,
                                nodes.replicas if nodes is not None else 1, self._params)

    def _resolve_precision(self, holds_whole: bool) -> None:
        self.dtype, self.device = self._params[0].dtype, _device_ops.materialization_device(self._params[0].device)
        self.master_dtype = torch.float32 if self.dtype in _LOW_PRECISION else self.dtype
        phase = param_phase_dtype(self.config.inter_node_param_dtype, self.sharding.shape, self.sharding.nodes,
                                  self.dtype)
        # A model that holds whole parameters holds its masters rounded (Note [Parameters across nodes in bf16]);
        # a stage-3 shard is the master and its gathers round (Note [Stage 3's parameters across nodes, rounded]).
        self.param_round = phase if holds_whole else None
        self.reduce_dtype = self.config.reduce_dtype or self.master_dtype
        scale_config = resolve_loss_scale(self.config.loss_scale, self.dtype)
        self.loss_scaler = LossScaler(scale_config) if scale_config is not None else None
        self._nonfinite = resolve_nonfinite(self.config.nonfinite, self.loss_scaler is not None)

    def _build_step_parts(self, optim, optim_kwargs) -> None:
        offloaded = self.config.offload in ("cpu", "nvme")
        on_disk = self.config.offload == "nvme"  # Note [Tiers] in tiers/__init__.py
        self.master_device = torch.device("cpu") if offloaded else self.device
        self._ops = _device_ops.current()
        # Scratch files are made on every rank or on none (every rank raises: Note [Tiers]).
        self.grad_file = made_everywhere(lambda: MappedShard(self.config.nvme_path, self.layout.shard_numel(),
                                                             self.master_dtype), self.world_group) if on_disk else None
        self.shard_grad = self.grad_file.tensor if on_disk else _offload.zeros(
            self.layout.shard_numel(), self.master_dtype, self.master_device, offloaded and self.config.pin_memory,
            self._ops)

        def stepper():
            return MasterStep(self.layout, self.rank, self.store.chunks, self.shard_grad, self.param_groups, optim,
                              optim_kwargs, master_dtype=self.master_dtype, offloaded=offloaded,
                              round_to=self.param_round, pin=offloaded and self.config.pin_memory, ops=self._ops,
                              disk=self.config if on_disk else None, grad_file=self.grad_file,
                              hold_model=self.store.holding if self.store.tier is not None else None)
        self.stepper = made_everywhere(stepper, self.world_group) if on_disk else stepper()
        self.master, self.inner = self.stepper.master, self.stepper.inner
        self.state_tier = self.stepper.tier  # offload="nvme" (Note [The optimizer's state on disk]), else None
        # Note [Weights edited in place]: whether an in-place edit of a parameter misses the optimizer.
        self._edits_watched = not self.store.holds_whole or self.stepper.has_master
        self._note_model_version()
        self._pieces, self._piece_params = self.stepper.pieces, self.stepper.piece_params
        self.publisher = Publisher(self.stepper, self.store, self._ops, self.device, self._phase)
        grad_shard = GradShard(self._params, self._pieces, self.stepper.piece_grads,
                               [slot.offset for slot in self.layout.params], self.process_group,
                               self.world_size, lambda: self.grads.had_grad(),
                               [slot.shape for slot in self.layout.params], device=self.shard_grad.device,
                               resting=[self.store.resting_shape(i) for i in range(len(self._params))])
        self.grads = GradSync(self._params, self.store.resting_grads, self.shard_grad, grad_shard,
                              self.world_group, self.sharding.shape.replicas, self._nonfinite, self._phase,
                              loss_scaled=self.loss_scaler is not None)
        if self.grad_file is not None:
            self.grads.zero_shard = lambda: self.grad_file.forget(0, self.grad_file.numel)

    @classmethod
    def from_config(cls, params, config, **overrides) -> "ShardedOptimizer":
        """Builds the optimizer a DeepSpeed config (dict or JSON path) describes (shardopt/deepspeed_config.py)."""
        from shardopt.deepspeed_config import optimizer_arguments, translate

        params, kwargs = optimizer_arguments(params, config, overrides)
        opt = cls(params, **kwargs)
        # A "scheduler" block (WarmupLR): call opt.lr_scheduler.step() after opt.step(), as DeepSpeed's engine does.
        scheduler = translate(config).scheduler
        opt.lr_scheduler = scheduler[0](opt, **scheduler[1]) if scheduler is not None else None
        return opt

    def _check_params(self) -> None:
        first = self._params[0]
        for i, p in enumerate(self._params):
            where = f"parameter {i} (shape {tuple(p.shape)})"
            if p.is_sparse:
                raise ValueError(f"{where} is sparse; ShardedOptimizer needs dense parameters")
            if not p.is_floating_point():
                raise TypeError(f"{where} has dtype {p.dtype}; only floating-point parameters can be trained")
            if p.device != first.device:
                raise ValueError(f"{where} is on {p.device} but parameter 0 is on {first.device}: "
                                 "move the whole model to one device before building the optimizer")
            if p.dtype != first.dtype:
                raise TypeError(f"{where} has dtype {p.dtype} but parameter 0 has {first.dtype}: "
                                "ShardedOptimizer needs one parameter dtype (cast the model, e.g. model.float() "
                                "or model.bfloat16())")

    def _attach(self, positions: list[int], gather_order: list[int], waits) -> None:
        """Called by ShardedDDP: builds the bucket engine in the model's backward order."""
        if self.grads.attached:
            raise RuntimeError("this ShardedOptimizer is already attached to a ShardedDDP model")
        flat_grad = self.store.flat_grad if self.store.flat_grad is not None else torch.empty(0, dtype=self.dtype)
        self.engine = build_engine(self.layout, plan_launch_order(self.layout, positions), gather_order,
                                   self.config, self.process_group, self.dtype, self.reduce_dtype, self.device,
                                   self._ops.copy_device(), flat_grad, self.shard_grad,
                                   waits_in_backward=self.store.waits_in_backward)
        if self.sharding.replicate is not None:
            self.engine.set_replicate_group(self.sharding.replicate, self.config.hop_format())
        if self.sharding.nodes is not None:  # Note [Two-level collectives] in parallel/mesh_plan.py
            self.engine.set_node_groups(self.sharding.node, self.sharding.across, self.config.hop_format())
            if self.param_round is not None:
                self.engine.set_gather_dtype(self.param_round)
        self.engine.set_loss_scale(self.loss_scale)
        if self.onebit is not None:
            self.onebit.sync_engine()
        self.grads.engine = self.engine
        self.store.attach(self.engine, waits)
        self.grads.attached = True

    def _detach_model(self) -> None:
        """The ShardedDDP was collected (Note [Hooks die with the wrapper] in ddp.py): a later step() raises."""
        try:
            if self.engine is not None:
                self.wait_params()
        finally:
            self.grads.detach()

    def add_param_group(self, param_group):
        if hasattr(self, "layout"):  # torch.optim.Optimizer.__init__ adds the constructor's groups first
            raise NotImplementedError("ShardedOptimizer cannot add parameter groups after construction: "
                                      "pass every group to the constructor")
        super().add_param_group(param_group)

    def _end_backward(self) -> None:
        # Stage 3's backward round is issued before any wait (Note [Stage 3 never waits in backward]).
        self.store.end_backward()
        self.grads.end_backward()
        if self.grad_file is not None:  # Note [The gradient shard on disk] in tiers/grad_shard.py
            self.grad_file.start_write_back()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the global gradient norm to max_norm and returns it, as torch.nn.utils.clip_grad_norm_ would."""
        if self._compressing():
            self._settle_rounds()
            return self.onebit.clip_grad_norm(max_norm, norm_type)
        self._grads_and_rounds()
        norm_type = float(norm_type)
        g = self.shard_grad
        # Totalled as torch's clip_grad_norm_ does (Note [Norms summed in the model's order] in grad_sync.py).
        norms = self.grads.norms_in_model_order(norm_type)
        if norms.numel():
            total = torch.linalg.vector_norm(norms.to(torch.promote_types(self.dtype, torch.float32)), norm_type)
            total = total.float()
        else:
            total = torch.zeros((), device=norms.device)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        g.mul_(coef.to(g.dtype))
        self.grads.shard.scale_all(coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forgets accumulated gradients. set_to_none=False keeps torch.optim's meaning: parameters that had a
        gradient keep a zero one, so the next step() still updates them (momentum, weight decay)."""
        if not set_to_none:
            self.stepper.settle()  # a step left open reads the gradients (Note [The step walked in the next forward])
        self.grads.zero(set_to_none)
        if set_to_none and self.grad_file is not None:  # Note [The gradient shard on disk] in tiers/grad_shard.py
            self.stepper.forget_grads()

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a loss scaler)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the current loss scale, for `opt.scale_loss(loss).backward()` (unscaled in the reduction)."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One optimizer step on every rank, or a skip on every rank if any rank saw inf/nan (see nonfinite)."""
        self.wait_params()
        self.check_params_in_place(take_edits=True)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._compressing():  # OneBitStep reduces local gradients and steps (Note [1-bit Adam under ZeRO])
            self._settle_rounds()
            t0 = time.perf_counter()
            skip = self.onebit.step()
            self._phase["step"] += time.perf_counter() - t0
            if not skip:
                self._publish_params(copy_master=True, defer=self.config.overlap_gather)
        else:
            used = self._grads_and_rounds()
            skip = self.grads.found_nonfinite
            if not skip:
                if self.config.max_grad_norm is not None:
                    self.clip_grad_norm(self.config.max_grad_norm)
                self.join.before_update()  # under Join: a joined rank's shard takes the others' clip (Note [Join])
                t0 = time.perf_counter()
                _inner_step(self, used)
                self._phase["step"] += time.perf_counter() - t0
                self._publish_params(copy_master=not self.stepper.step_writes_model,
                                     defer=self.config.overlap_gather)
            if self.onebit is not None:
                self.onebit.after_warmup_step(skip)
        if skip and self.engine is not None:
            self.engine.reset_hop_residual()  # it holds the inf/nan too (Note [Compressed inter-node hop])
        if skip and self.loss_scaler is None:
            warnings.warn("ShardedOptimizer skipped a step: gradients held inf/nan on some rank "
                          "(nonfinite='skip')", RuntimeWarning, stacklevel=2)
        self.skipped_steps += int(skip)
        self.last_step_skipped = skip
        if self.loss_scaler is not None:
            self.loss_scaler.update(skip)
            self.engine.set_loss_scale(self.loss_scaler.scale)
        self.grads.end_step()
        return loss

    def _compressing(self) -> bool:
        """OneBitAdam past its warm-up: its OneBitStep steps (onebit_step.py)."""
        return self.onebit is not None and self.onebit.compressing

    def _local_grads(self) -> bool:
        """Backward passes keep gradients local, to be exchanged at step() (OneBitAdam's flat mesh)."""
        return self.onebit is not None and self.onebit.local_grads()

    def _load_master_from_model(self) -> None:
        """Master chunks take the model's values (at construction, after ShardedDDP's broadcast, a load)."""
        self.wait_params()
        self.stepper.load_from_model()
        self._note_model_version()

    def _load_master_from_values(self, values: dict) -> None:
        """Master pieces take loaded values at their own precision ({parameter index: full tensor}; ddp.py)."""
        self.wait_params()
        self.stepper.load_values(values)
        self._note_model_version()

    # Note [Weights edited in place]
    # Masters (Note [Master weights] in master_step.py) must not undo weights edited in place between steps
    # (WGAN's clamp_): before each step and save, if `p._version` counts moved, the masters take the edits (not per
    # forward: an EMA's swap would round them). Refused at stage 3; a compiled forward moves the counts itself.
    def _note_model_version(self) -> None:
        """The parameters' in-place change counts now hold no edit the optimizer has not taken."""
        self._model_versions = list(map(_VERSION, self._params)) if self._edits_watched else None

    def _take_model_edits(self, names: list[str] | None = None, saving: bool = False) -> None:
        """Masters take in-place edits (Note above); saving: compare values whatever the counts say (p.data)."""
        if not self._edits_watched:
            return
        versions = list(map(_VERSION, self._params))  # C loops, as the check above
        if versions == self._model_versions and not (saving and self.store.holds_whole):
            return
        if not self.store.holds_whole:
            i = next(i for i, (v, w) in enumerate(zip(versions, self._model_versions)) if v != w)
            self._note_model_version()
            name = f"parameter '{names[i]}'" if names else f"parameter {i} (shape {self.layout.params[i].shape})"
            raise RuntimeError(
                f"{name} was changed in place outside a forward (with torch.no_grad(): p.op_(), p.copy_(...), "
                f"nn.init): at stage 3 a parameter is an empty tensor between uses, so the change did "
                f"nothing. Make it inside `with opt.full_params():` (every rank), which gathers the weights "
                f"and keeps what the block writes.")
        self.wait_params()
        self.stepper.take_model_writes()
        self._note_model_version()

    def _publish_params(self, copy_master: bool = True, defer: bool = False) -> None:
        """Every rank's updated chunks into the model (a collective; publish.py)."""
        self.grads.require_engine()
        self.publisher.publish(copy_master, defer)

    # Note [Parameters stay in the flat buffer]
    # Every managed parameter is a view into the buffer where the all-gather writes; new storage given after
    # wrapping (`p.data = ...`, model.half()) would cut it loose (stage 3: Note [Parameters between gathers]).
    def check_params_in_place(self, names: list[str] | None = None, take_edits: bool = False) -> None:
        """Raises if a managed parameter left the flat buffer; take_edits: the masters take in-place edits."""
        if self.store.all_in_place():
            if take_edits or not self.store.holds_whole:  # stage 3 refuses an edit at every check
                self._take_model_edits(names)
            return
        for i, p in enumerate(self._params):
            if self.store.moved(i) or p.dtype != self.dtype:
                name = f"parameter '{names[i]}'" if names else f"parameter {i} (shape {tuple(p.shape)})"
                dtype = f" (its dtype is now {p.dtype}, was {self.dtype})" if p.dtype != self.dtype else ""
                raise RuntimeError(
                    f"{name} was given new storage after ShardedOptimizer was built{dtype}: p.data = ..., "
                    f"model.to(dtype), model.half() or model.float() after wrapping cut it loose from the "
                    f"optimizer's flat buffer. Cast or move the model first, then build ShardedOptimizer and "
                    f"ShardedDDP; to change values, copy in place (with torch.no_grad(): p.copy_(new)).")
        self._take_model_edits(names)  # stage 3: an edit outside full_params() did nothing (refused)

    def wait_params(self) -> None:
        """Returns once every parameter holds the last step's value (Note [Gathering in the next forward])."""
        self.publisher.wait()

    def _wait_buckets(self, buckets) -> None:
        """A module's forward pre-hook (overlap_gather): waits for the buckets holding its parameters."""
        self.publisher.wait_buckets(buckets)

    @contextlib.contextmanager
    def full_params(self, writeback: bool = True):
        """Every parameter whole on this rank inside the block (a collective), for code outside a forward (an
        EMA, generate()). writeback=True: values written inside become the parameters' values, masters included."""
        self.wait_params()
        with self.store.gathered(writeback):
            yield
        if writeback:
            self.stepper.take_model_writes()
        self._note_model_version()  # the block's in-place writes are taken (or, writeback=False, dropped)

    def _grads_and_rounds(self) -> torch.Tensor:
        """Gradients reduced, and at stage 3 every backward round walked (Note [Stage-3 schedule])."""
        self._settle_rounds()
        return self.grads.finish(at_step=self._at_step)

    def _at_step(self) -> None:
        """The step's agreements (Note [Join] in join.py; Note [Passes every rank agrees on] at stage 3)."""
        self.join.at_step()
        self.store.start_step()

    def join_hook(self, **kwargs):
        """The hook torch's Join runs on a rank out of inputs (the ShardedDDP's does the same)."""
        return self.join.make_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.world_group

    def _settle_rounds(self) -> None:
        """Stage 3: the backward rounds this rank owes, walked before any step's collective."""
        self.store.settle()

    @property
    def params_sharded(self) -> bool:
        """Whether parameters are empty tensors between uses (stage 3): reading them then needs full_params()."""
        return not self.store.holds_whole

    def phase_seconds(self) -> dict:
        """Cumulative wall seconds this rank spent per phase: reduce (waiting at the end of backward), copy, step,
        publish, gather (with overlap_gather, only the exposed waits); io: waiting for the disk tiers' transfers
        (within step and publish)."""
        out = dict(self._phase)
        out["copy"] = self.engine.copy_seconds if self.engine is not None else 0.0
        tier, params = self.state_tier, self.store.tier
        out["io"] = (tier.ring.exposed + self.grad_file.exposed if tier is not None else 0.0) + \
            (params.exposed if params is not None else 0.0)
        return out

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the whole optimizer state on rank `to` for state_dict() (call on every rank)."""
        from shardopt.checkpoint import optim_state
        self.wait_params()
        optim_state.consolidate_state_dict(self, to)

    def state_dict(self):
        """The whole state in torch.optim's format, on the rank consolidate_state_dict(to=...) named."""
        from shardopt.checkpoint import optim_state
        return optim_state.optimizer_state_dict(self)

    def load_state_dict(self, state_dict):
        """Loads a whole torch.optim-format state dict (call on every rank; each takes its ranges)."""
        from shardopt.checkpoint import optim_state
        self.wait_params()
        optim_state.load_optimizer_state_dict(self, state_dict)

    def memory_stats(self) -> dict:
        """Bytes this rank holds in parameters, masters, gradients, optimizer state and staging, by device; with
        disk tiers, `tier_buffers` (their host buffers) and `on_disk` (bytes per kind of state in their files)."""
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts)
        state = self.stepper.state_tensors()
        shard_grad = [self.shard_grad] if self.grad_file is None else []  # on disk: Note [The gradient shard on disk]
        stats = {
            "params": self.store.param_bytes(),
            "master": nbytes([self.master]) if self.master is not None else 0,
            "grads": nbytes(shard_grad + ([self.store.flat_grad] if self.store.flat_grad is not None else [])),
            "optimizer_state": nbytes(state),
            "staging": self.engine.staging_bytes if self.engine is not None else 0,
            # int8 inter-node hop: error feedback (Note [Compressed inter-node hop]).
            "hop_residual": self.engine.hop_residual_bytes if self.engine is not None else 0,
        }
        if self.onebit is not None:  # residuals, frozen denominators, sketch signs: host memory (Note [1-bit Adam under ZeRO])
            stats["onebit"] = self.onebit.host_bytes()
        tier, params = self.state_tier, self.store.tier
        stats["tier_buffers"] = (tier.ring.nbytes if tier is not None else 0) + \
            (params.buffer_bytes() if params is not None else 0)
        stats["on_disk"] = dict(tier.disk_bytes(), grads=self.grad_file.nbytes) if tier is not None else {}
        if params is not None:
            stats["on_disk"]["params"] = params.disk_bytes()
        host = stats["master"] + nbytes(shard_grad) + stats["optimizer_state"] + stats["tier_buffers"] \
            if self.config.offloaded else 0
        stats["offloaded"] = host
        stats["on_device"] = sum(stats[k] for k in ("params", "master", "grads", "optimizer_state", "staging",
                                                    "hop_residual", "tier_buffers")) - host
        return stats


def _inner_step(opt: ShardedOptimizer, used) -> None:
    """The inner step; with disk tiers an I/O error in it (or in the walk the last step left open) raises on every
    rank (a failed rank's peers would otherwise wait in the gather after it), and the run resumes from its last
    checkpoint."""
    if opt.state_tier is None and opt.store.tier is None:
        opt.stepper.step(used, opt.param_groups)
        return
    error = None
    try:
        opt.stepper.raise_step_error()
        opt.stepper.step(used, opt.param_groups)
        if opt.store.tier is not None and opt.stepper.pending is None:
            opt.store.tier.written()
    except Exception as e:  # noqa: BLE001 - handed to every rank
        error = e
    failed_anywhere(error, opt.world_group, "the step's disk I/O")


def _constructor_signature() -> inspect.Signature:
    """The signature help() and the integrations read: every ShardConfig field is a keyword-only option."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    fields = [inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
              for f in dataclasses.fields(ShardConfig)]
    return inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("params", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("optim", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
        + fields + [inspect.Parameter(n, keyword, default=None) for n in ("process_group", "mesh", "shard_group")]
        + [inspect.Parameter("optim_kwargs", inspect.Parameter.VAR_KEYWORD)])


ShardedOptimizer.__init__.__signature__ = _constructor_signature()
