"""ShardedOptimizer: each rank steps only its chunks of the parameters (ZeRO stages 1, 2 and 3).

Where the parameters live is its parameter store's, chosen once here by the stage (Note [One parameter
store] in param_store.py): flat_params.py for stages 1-2, zero3/ for stage 3. The constructor is wiring:
config -> groups -> layout -> the store -> the rooms below.

Lifecycle of one iteration (see Note [Flat layout] in layout.py and Note
[Bucket engine] in csrc/comm/bucket_engine.h):
  backward  -> ShardedDDP's hooks hand gradients to the bucket engine, which
               reduce-scatters each bucket into this rank's gradient shard;
  clip      -> one all-reduce of the local squared norm;
  step      -> one all-reduce of "which parameters got a gradient anywhere,
               and did any rank see an inf/nan", the inner torch optimizer
               steps this rank's pieces (fp32 master values), and the store
               puts every rank's updated chunks into the model.

The rooms it asks: the store (where parameters live), grad_sync.py (the end of backward, p.grad, the
step's flags), master_step.py (the inner optimizer on this rank's pieces; Note [Master weights]),
publish.py (updated chunks back into the model), onebit.py (OneBitAdam's compressed steps).
"""
from __future__ import annotations

import contextlib
import operator
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, _JoinConfig

from shardopt.config import (DEFAULT_ALLGATHER_BUCKET_SIZE, DEFAULT_REDUCE_BUCKET_SIZE, ShardConfig,
                             auto_bucket_size)
from shardopt import device_ops as _device_ops
from shardopt import offload as _offload
from shardopt import onebit as _onebit
from shardopt.elementwise import check_elementwise
from shardopt.flat_params import FlatStore
from shardopt.grad_sync import GradSync, build_engine
from shardopt.join import JoinRoom
from shardopt.master_step import MasterStep
from shardopt.publish import Publisher
from shardopt.parallel.consistency import check_same_across_ranks
from shardopt.layout import Layout, plan_launch_order
from shardopt.parallel.mesh import require_dist, resolve_groups
from shardopt.parallel.mesh_plan import param_phase_dtype
from shardopt.precision import LossScaler, resolve_loss_scale, resolve_nonfinite
from shardopt.sharded_grad import GradShard
from shardopt.view import OptimizerView
from shardopt.zero3.store import ShardedStore

_LOW_PRECISION = (torch.bfloat16, torch.float16)

_VERSION = operator.attrgetter("_version")


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """Drop-in replacement for a torch.optim optimizer that shards its state over ranks.

    `optim` is an elementwise torch optimizer class; `optim_kwargs` go to it.
    `param_groups` is the user's view (LR schedulers work unchanged); the inner
    optimizer runs on this rank's pieces (see layout.py) with the same groups.
    Use with `ShardedDDP(model, optimizer)`, which feeds it gradients.
    """

    def __init__(self, params, optim=None, *, stage: int = 2,
                 reduce_bucket_size: int | None = DEFAULT_REDUCE_BUCKET_SIZE,
                 allgather_bucket_size: int | None = DEFAULT_ALLGATHER_BUCKET_SIZE, overlap_comm: bool = True,
                 overlap_gather: bool = False, offload: str = "none", pin_memory: bool = True,
                 reduce_dtype: torch.dtype | None = None, loss_scale="auto", nonfinite: str = "auto",
                 max_grad_norm: float | None = None,
                 process_group=None, mesh=None, shard_group: str | None = None, inter_node_dtype=None,
                 num_staging_buffers: int = 2, comm_impl: str = "auto", reshard_after_forward: bool = True,
                 prefetch_bucket_size: int | None = None, max_live_parameters: int | None = None,
                 param_persistence_threshold: int = 0, node_aware: bool | None = None,
                 inter_node_param_dtype=None, shared_memory_gather: bool | None = None, **optim_kwargs):
        self.config = ShardConfig(
            stage=stage, reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=allgather_bucket_size,
            overlap_comm=overlap_comm, overlap_gather=overlap_gather, offload=offload, pin_memory=pin_memory,
            reduce_dtype=reduce_dtype, loss_scale=loss_scale, nonfinite=nonfinite, max_grad_norm=max_grad_norm,
            num_staging_buffers=num_staging_buffers, comm_impl=comm_impl, inter_node_dtype=inter_node_dtype,
            reshard_after_forward=reshard_after_forward, prefetch_bucket_size=prefetch_bucket_size,
            max_live_parameters=max_live_parameters, param_persistence_threshold=param_persistence_threshold,
            node_aware=node_aware, inter_node_param_dtype=inter_node_param_dtype,
            shared_memory_gather=shared_memory_gather)
        # OneBitAdam: our AdamW path plus the compression room (Note [1-bit Adam under ZeRO] in onebit.py).
        optim, optim_kwargs, onebit_config = _onebit.split_options(optim, optim_kwargs, self.config.offload)
        optim, optim_kwargs = _offload.default_optimizer(optim, optim_kwargs, self.config.offload)
        check_elementwise(optim)
        require_dist()  # before any work: the groups are resolved once the parameters are known
        # The inner optimizer's own defaults, validated by constructing it once on a dummy tensor.
        super().__init__(params, dict(optim([torch.zeros(1, requires_grad=True)], **optim_kwargs).defaults))
        self.optim_class = optim
        self._take_params()
        self._resolve_groups(process_group, mesh, shard_group)
        # The one place the stage picks how parameters are kept (Note [One parameter store]).
        store_class = ShardedStore if self.config.stage == 3 else FlatStore
        self.layout: Layout = self._plan(store_class)
        self._resolve_precision()
        check_same_across_ranks(
            self.sharding.signature() + self.config.signature()
            + [f"optimizer {optim.__module__}.{optim.__qualname__}", f"dtype {self.dtype}"] + self.layout.signature()
            + [f"group {g} " + repr({k: v for k, v in grp.items() if k != "params"})
               for g, grp in enumerate(self.param_groups)],
            "parameters and optimizer configuration", self.world_group)
        self._phase = dict.fromkeys(("reduce", "step", "publish", "gather"), 0.0)  # see phase_seconds()
        self.store = store_class(self.layout, self.rank, self._params, self.sharding, self.config, self.device,
                                 self._phase)
        self._build_rooms(optim, optim_kwargs)
        # What checkpoint/, DCP, the integrations and onebit.py see of it (Note [The optimizer's view] in view.py).
        self.view = OptimizerView(self)
        self.engine = None          # created by ShardedDDP (it knows the model's parameter order)
        self.onebit = _onebit.OneBitStep(self, onebit_config) if onebit_config is not None else None
        self.skipped_steps = 0
        self.last_step_skipped = False
        # torch's Join (`with Join([model, opt])`): a rank out of batches shadows the others (Note [Join]).
        self._join_config = _JoinConfig.construct_disabled_join_config()
        self.join = JoinRoom(self)

    # ----------------------------------------------------------------- setup
    def _take_params(self) -> None:
        """The trainable parameters, in the groups' order, checked."""
        self._params: list[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]
                                                  if p.requires_grad]
        if not self._params:
            raise ValueError("ShardedOptimizer got no parameter that requires grad")
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._check_params()

    def _resolve_groups(self, process_group, mesh, shard_group) -> None:
        """Which ranks shard together and which replicate (Note [Hybrid sharding] in mesh_plan.py).
        process_group / rank / world_size are the shard group's: the layout is split over it."""
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

    def _resolve_precision(self) -> None:
        """The model's dtype and device, the masters', the reductions' and the loss scaling."""
        self.dtype, self.device = self._params[0].dtype, _device_ops.materialization_device(self._params[0].device)
        # fp32 master values for a low-precision model; otherwise the model's own dtype.
        self.master_dtype = torch.float32 if self.dtype in _LOW_PRECISION else self.dtype
        # Parameters crossing nodes narrower than the model (Note [Parameters across nodes in bf16]).
        self.param_round = param_phase_dtype(self.config.inter_node_param_dtype, self.sharding.shape,
                                             self.sharding.nodes, self.dtype)
        self.reduce_dtype = self.config.reduce_dtype or self.master_dtype
        scale_config = resolve_loss_scale(self.config.loss_scale, self.dtype)
        self.loss_scaler = LossScaler(scale_config) if scale_config is not None else None
        self._nonfinite = resolve_nonfinite(self.config.nonfinite, self.loss_scaler is not None)

    def _build_rooms(self, optim, optim_kwargs) -> None:
        """The gradient shard, the master step, the publisher and the gradient sync over the store's chunks."""
        offloaded = self.config.offload == "cpu"
        self.master_device = torch.device("cpu") if offloaded else self.device
        # GPU-only operations (pinning, side-stream copies, events): Note [Device
        # operations behind an interface] in device_ops.py.
        self._ops = _device_ops.current()
        self.shard_grad = _offload.zeros(self.layout.shard_numel(), self.master_dtype, self.master_device,
                                         offloaded and self.config.pin_memory, self._ops)
        self.stepper = MasterStep(self.layout, self.rank, self.store.chunks, self.shard_grad, self.param_groups,
                                  optim, optim_kwargs, master_dtype=self.master_dtype, offloaded=offloaded,
                                  round_to=self.param_round, pin=offloaded and self.config.pin_memory, ops=self._ops)
        self.master, self.inner = self.stepper.master, self.stepper.inner
        # Note [Weights edited in place]: whether an in-place edit of a parameter misses the optimizer.
        self._edits_watched = not self.store.holds_whole or self.master is not None
        self._note_model_version()
        self._pieces, self._piece_params = self.stepper.pieces, self.stepper.piece_params
        self.publisher = Publisher(self.stepper, self.store, self._ops, self.device, self._phase)
        # p.grad once reduced (Note [Sharded p.grad] in sharded_grad.py).
        grad_shard = GradShard(self._params, self._pieces, self.stepper.piece_grads,
                               [slot.offset for slot in self.layout.params], self.process_group,
                               self.world_size, lambda: self.grads.had_grad(),
                               [slot.shape for slot in self.layout.params], device=self.shard_grad.device,
                               resting=[self.store.resting_shape(i) for i in range(len(self._params))])
        self.grads = GradSync(self._params, self.store.resting_grads, self.shard_grad, grad_shard,
                              self.world_group, self.sharding.shape.replicas, self._nonfinite, self._phase,
                              loss_scaled=self.loss_scaler is not None)

    @classmethod
    def from_config(cls, params, config, **overrides) -> "ShardedOptimizer":
        """Builds the optimizer a DeepSpeed config (dict or JSON path) describes.

        Keyword arguments override the config (e.g. process_group=...). What each
        key means, and which are refused: shardopt/deepspeed_config.py.
        """
        from shardopt.deepspeed_config import optimizer_arguments, translate

        params, kwargs = optimizer_arguments(params, config, overrides)
        opt = cls(params, **kwargs)
        # A "scheduler" block (WarmupLR): call opt.lr_scheduler.step() after opt.step(), as DeepSpeed's engine does.
        scheduler = translate(config).scheduler
        opt.lr_scheduler = scheduler[0](opt, **scheduler[1]) if scheduler is not None else None
        return opt

    # ----------------------------------------------------------------- setup
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
        """Called by ShardedDDP: builds the bucket engine in the model's backward order.

        gather_order: indices into layout.gather_spans, in the order the
        forward needs them (prefetch.plan_gather_order); waits: the buckets
        each module's forward waits for (prefetch.plan_forward_waits).
        """
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
        """Called when the ShardedDDP wrapper is collected (Note [Hooks die with the wrapper] in ddp.py).

        Gradients no longer reach the engine: a later step() raises instead of
        stepping without gradients, and a new ShardedDDP may attach. The engine
        stays until then, for its counters and memory_stats().
        """
        if self.engine is not None:
            self.wait_params()
        self.grads.detach()

    def add_param_group(self, param_group):
        if hasattr(self, "layout"):  # torch.optim.Optimizer.__init__ adds the constructor's groups first
            raise NotImplementedError("ShardedOptimizer cannot add parameter groups after construction: "
                                      "pass every group to the constructor")
        super().add_param_group(param_group)

    # -------------------------------------------------------------- gradients
    # ShardedDDP's hooks call this (the work is the store's and grad_sync.py's).
    def _end_backward(self) -> None:
        # Stage 3: every all-gather of the backward round is issued before this rank waits for any
        # reduce-scatter (Note [Stage 3 never waits in backward] in csrc/comm/bucket_engine.cpp).
        self.store.end_backward()
        self.grads.end_backward()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the global gradient norm (over every rank's shard) to max_norm; returns the norm.

        Same result as torch.nn.utils.clip_grad_norm_ on the full averaged gradients.
        """
        if self._compressing():
            self._settle_rounds()
            return self.onebit.clip_grad_norm(max_norm, norm_type)
        self._grads_and_rounds()
        norm_type = float(norm_type)
        g = self.shard_grad
        # Per-parameter norms over every rank (cached for the 2-norm: Note [Sharded p.grad]), then their norm
        # as torch.nn.utils.clip_grad_norm_ forms it from the per-parameter norms it gets (in the gradients'
        # dtype, at least float32, in the model's order: Note [Norms summed in the model's order] in
        # grad_sync.py): the same total, bit for bit, as that call over model.parameters().
        norms = self.grads.norms_in_model_order(norm_type)
        if norms.numel():
            total = torch.linalg.vector_norm(norms.to(torch.promote_types(self.dtype, torch.float32)), norm_type)
            total = total.float()
        else:
            total = torch.zeros((), device=norms.device)
        # As torch.nn.utils.clip_grad_norm_: scale by a clamped coefficient.
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        g.mul_(coef.to(g.dtype))
        self.grads.shard.scale_all(coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forgets accumulated gradients (the shard, and .grad of the managed parameters).

        set_to_none=False keeps torch.optim's meaning: parameters that had a
        gradient keep a zero one, so the next step() updates them (momentum,
        weight decay) even if no backward reaches them.
        """
        self.grads.zero(set_to_none)

    # ------------------------------------------------------ loss scaling
    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a loss scaler)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the current loss scale: call `opt.scale_loss(loss).backward()` (loss itself without one).

        Gradients are unscaled during their reduction (Note [Unscaling inside
        the reduction] in precision.py), so clip_grad_norm and step see true
        gradients; there is nothing else to call.
        """
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One optimizer step on every rank, or a skip on every rank if any rank saw inf/nan (see nonfinite)."""
        self.wait_params()
        self.check_params_in_place(take_edits=True)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._compressing():  # the room reduces local gradients and steps (Note [1-bit Adam under ZeRO])
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
                self.stepper.step(used, self.param_groups)
                self._phase["step"] += time.perf_counter() - t0
                self._publish_params(copy_master=not self.stepper.kernel_writes_model,
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
        """OneBitAdam past its warm-up: its room steps (onebit.py)."""
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
    # ------------------------------
    # Under DDP, code between steps may change weights in place: `with torch.no_grad(): p.clamp_(-c, c)`
    # (WGAN), `p.copy_(pretrained)`, `nn.init.*_(p)`, `model.apply(init)`; the next step starts from the
    # new values. Where this rank's chunks of the model are the optimizer's parameters (an fp32 model at
    # stages 1-2, not offloaded), that holds here too. With separate master weights (a bf16/fp16 model,
    # offload, the bf16 parameter hop: Note [Master weights] in master_step.py) the next step started from
    # the masters and wrote them over the edit: silently undone (seen, 2026-11-27: weights clamped to 0.01
    # were back at 4.1 one step later). torch counts in-place changes per tensor (`p._version`: ops on p,
    # on p.detach(), nn.init); ShardedOptimizer's own writes go through the flat buffer's views and do not
    # count. So before each step (and each save), if the parameters' counts moved, this rank's master chunks
    # take the edited elements (Note [Writing back keeps the master's bits]); a list of the counts, when
    # nothing moved, is the whole cost (well under 1 ms at 8000 tensors). Not before each forward: a forward
    # uses the model's weights as they are anyway, and code that swaps other weights in for an evaluation
    # and copies the old ones back before training on (an EMA's) leaves nothing changed, so the masters keep
    # their fp32 bits (taken at the evaluation's forward, they came back rounded). At stage 3 a parameter is an
    # empty tensor between uses, so such an edit changed nothing: refused, naming full_params(); a stage-3
    # forward under torch.compile moves the counts itself (seen on torch 2.13), so they are noted again at
    # each forward's end (ddp.py), and a check (at each forward and step) sees only what changed since.
    # Writes through `p.data` are not counted by torch: a step does not see them (docs/guide.md says so), but
    # a save does, at stages 1-2: there the masters take every element whose model value is not their
    # rounding, counted or not (one pass over the shard, next to writing it out). Seen: Lightning's
    # WeightAveraging copies the average into the module through p.data at the end of fit; with offload the
    # checkpoint saved after held the weights from before it.
    def _note_model_version(self) -> None:
        """The parameters' in-place change counts now hold no edit the optimizer has not taken."""
        self._model_versions = list(map(_VERSION, self._params)) if self._edits_watched else None

    def _take_model_edits(self, names: list[str] | None = None, saving: bool = False) -> None:
        """Masters take the weights user code changed in place since the last look (Note above). saving: for a
        checkpoint, compare the values whatever the counts say (writes through p.data, Lightning's
        WeightAveraging putting the average in at the end of fit)."""
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
    # Every managed parameter is a view into flat_param: the all-gather writes
    # there, the optimizer steps there. Code that gives a parameter new storage
    # after wrapping (`p.data = ...`, model.to(dtype), model.half()) cuts it
    # loose: the optimizer would go on stepping the buffer while the model
    # computes with the new tensor. That cannot work, so it is refused: before
    # each forward (ShardedDDP) and each step, on every rank, before anything
    # wrong is computed. At stage 3 a parameter is its bucket's view while
    # gathered and an empty tensor between uses (Note [Parameters between
    # gathers] in zero3/store.py); anything else was put there by user code.
    def check_params_in_place(self, names: list[str] | None = None, take_edits: bool = False) -> None:
        """Raises if a managed parameter no longer lives in the flat buffer (see the Note above). Weights edited
        in place (Note [Weights edited in place]): refused at stage 3; take_edits (at a step): into the masters."""
        # Every forward: C loops over the parameters when nothing moved (the usual case).
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
        """Returns once every parameter holds the last step's value on this rank.

        Only needed with overlap_gather=True, before reading parameters outside
        a forward between step() and the next forward (Note [Gathering in the
        next forward] in prefetch.py); cheap when nothing is in flight. Every
        path that writes master chunks (step, loads) calls it first: it also
        waits for the device to have read the master chunks of a non-blocking
        copy back (offload to pinned memory; Note [Device operations behind an
        interface] in device_ops.py).
        """
        self.publisher.wait()

    def _wait_buckets(self, buckets) -> None:
        """A module's forward pre-hook (overlap_gather): waits for the buckets holding its parameters."""
        self.publisher.wait_buckets(buckets)

    @contextlib.contextmanager
    def full_params(self, writeback: bool = True):
        """Every parameter whole on this rank inside the block (a collective: every rank enters it).

        For code that reads or writes weights outside a forward: an EMA, weight
        logging, generate() on the bare module. At stage 3 it gathers every
        bucket and frees them on exit; at stages 1-2 parameters are whole
        anyway (it waits for gathers in flight). writeback=True: values written
        inside become the parameters' values (master weights included); with a
        bf16/fp16 model, elements left alone keep their fp32 master (Note
        [Writing back keeps the master's bits] in master_step.py).
        """
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
        """Every rank has joined its peers' backward reductions: the step's agreements (under torch's Join,
        Note [Join] in join.py; at stage 3, Note [Passes every rank agrees on])."""
        self.join.at_step()
        self.store.start_step()

    # ------------------------------------------------------ torch's Join (Note [Join] in join.py)
    def join_hook(self, **kwargs):
        """The hook torch's Join runs on a rank out of inputs: it shadows the others' whole iteration (forward,
        backward, this rank's part of the step), as the ShardedDDP's does (one covers both)."""
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
        """Whether the model's parameters are empty tensors between uses (stage 3), so code that reads or writes
        weights outside a forward needs `with opt.full_params():` (Note [One parameter store])."""
        return not self.store.holds_whole

    def phase_seconds(self) -> dict:
        """Cumulative wall seconds this rank spent per phase since construction.

        reduce: waiting for reductions at the end of backward (communication
        not hidden behind backward); copy: moving reduced chunks into the
        gradient shard (device to host with offload; inside reduce or
        backward); step: the inner optimizer; publish: master chunks into the
        model (when separate); gather: starting the all-gather of updated
        parameters and waiting for it (inside step(), or with overlap_gather
        in the next forward's pre-hooks: then only the exposed waits count).
        """
        out = dict(self._phase)
        out["copy"] = self.engine.copy_seconds if self.engine is not None else 0.0
        return out

    # ------------------------------------------ state dicts (optim_state.py, checkpoint/save_load.py)
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

    # ------------------------------------------------------------ inspection
    def memory_stats(self) -> dict:
        """Bytes this rank holds in parameters, master weights, gradients, optimizer state and staging
        buffers, and how much of it is on the model's device vs offloaded to the host. With OneBitAdam,
        "onebit": its compression state (host memory, not in on_device)."""
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts)
        state = self.stepper.state_tensors()
        stats = {
            "params": self.store.param_bytes(),
            "master": nbytes([self.master]) if self.master is not None else 0,
            "grads": nbytes([self.shard_grad] + ([self.store.flat_grad] if self.store.flat_grad is not None else [])),
            "optimizer_state": nbytes(state),
            "staging": self.engine.staging_bytes if self.engine is not None else 0,
            # int8 inter-node hop: error feedback (Note [Compressed inter-node hop]).
            "hop_residual": self.engine.hop_residual_bytes if self.engine is not None else 0,
        }
        if self.onebit is not None:  # residuals, frozen denominators, sketch signs: host memory (Note [1-bit Adam under ZeRO])
            stats["onebit"] = self.onebit.host_bytes()
        # Where they live: with offload, master, gradient shard and state are host memory.
        host = stats["master"] + nbytes([self.shard_grad]) + stats["optimizer_state"] \
            if self.config.offload == "cpu" else 0
        stats["offloaded"] = host
        stats["on_device"] = sum(stats[k] for k in ("params", "master", "grads", "optimizer_state", "staging",
                                                    "hop_residual")) - host
        return stats

