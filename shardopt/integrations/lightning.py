"""PyTorch Lightning strategy: `Trainer(strategy="shardopt")` trains with ShardedOptimizer + ShardedDDP.

    import shardopt.integrations.lightning            # registers "shardopt" (and variants) with Lightning
    trainer = lightning.Trainer(strategy="shardopt", devices=2, precision="bf16-mixed")
    trainer = lightning.Trainer(strategy=ShardedStrategy(stage=1, reduce_bucket_size=int(5e7)))

Lightning finds strategy names only in its own package (it has no entry-point
group for strategies), so the string form needs this module imported first.

What the strategy does on top of Lightning's DDPStrategy (process group,
launcher, samplers, reductions are DDP's):
  * the optimizer from `configure_optimizers` is rebuilt as a ShardedOptimizer
    with the same class, groups and hyper-parameters (Note [Rebinding LR schedulers]);
  * the LightningModule is wrapped in ShardedDDP; `accumulate_grad_batches`
    uses its `no_sync`;
  * `gradient_clip_val` clips the global norm over every rank's shard (or, with
    gradient_clip_algorithm="value", every element of the shards);
  * precision goes through ShardedPrecision (bf16/fp16 model, fp32 master
    weights in the optimizer, loss scaling for fp16);
  * `trainer.save_checkpoint(path)` writes shardopt's sharded checkpoint (a
    directory; every rank writes its own part) and `fit(ckpt_path=...)` loads
    it at any number of devices.

Note [Lightning at stage 3]
---------------------------
During fit a stage-3 module's parameters are empty between uses; training,
validation, test and predict steps run through the wrapper's hooks on every
rank (Lightning gives every rank as many batches). Lightning reads the
weights on every rank before each save (lightning_module_state_dict): at stage
3 that returns nothing, since the sharded checkpoint holds the weights; a
weights-only save (ModelCheckpoint(save_weights_only=True)) gathers them in
save_checkpoint, where every rank is, bucket by bucket onto rank 0 only, which
writes the usual file (Note [Weights-only saves at stage 3]). When fit ends
the module gets its whole weights back on every rank
(ShardedDDP.detach(), a collective at teardown), so what follows fit (reading
model.state_dict() on rank 0, validate/test/predict, a new fit of a copy) sees
a plain module, as after DDP; the price is the whole model on every rank from
then on. A fit that raised leaves them sharded (empty), with a warning.

A model too big for one rank cannot take that price:
ShardedStrategy(whole_weights_after_fit=False) leaves the module sharded when
fit ends, held by its wrapper (shardopt.wrapper_of(module)). What follows fit
then runs as during it: validate/test/predict gather through the stage-3
hooks on every rank; trainer.save_checkpoint(path, weights_only=True) streams
onto rank 0 as above; read single weights with `with
shardopt.wrapper_of(module).optimizer.full_params(): ...` on every rank (these
three tested). trainer.save_checkpoint(path) (the sharded checkpoint) and
shardopt.save_weights(module, folder) go through the same wrapper, bucket by
bucket, but are not yet tested after fit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
import shutil
import warnings
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.overrides.distributed import _sync_module_states
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
    from lightning_utilities import apply_to_collection
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("shardopt.integrations.lightning needs the `lightning` package: pip install 'shardopt[lightning]'") from e

import shardopt
from shardopt.config import ShardConfig
from shardopt.ddp import ShardedDDP
from shardopt.optimizer import ShardedOptimizer
from shardopt.weights.rank0 import state_dict_on_rank0, torch_save_atomic

# Arguments of ShardedOptimizer the strategy fills in itself.
_OWN_OPTIMIZER_ARGS = ("params", "optim", "process_group")


def _optimizer_options() -> set[str]:
    """ShardedOptimizer's keyword-only options (stage, bucket sizes, offload, loss scaling, ...)."""
    sig = inspect.signature(ShardedOptimizer.__init__).parameters
    return {n for n, p in sig.items() if p.kind is p.KEYWORD_ONLY and n not in _OWN_OPTIMIZER_ARGS}


# ------------------------------------------------------------------ precision
_PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ShardedPrecision(Precision):
    """Precision of ShardedStrategy: the model's parameters in `dtype`, fp32 master weights in the optimizer.

    "32-true": nothing changes. "bf16-mixed" / "16-mixed": the module is cast to
    bf16 / fp16 before the optimizer is built, floating-point inputs are cast to
    it, and ShardedOptimizer keeps fp32 master chunks (as DeepSpeed's bf16/fp16
    modes do; no autocast). With fp16, `opt.scale_loss` scales the loss before
    backward and the optimizer unscales, skips non-finite steps and adapts the
    scale. On CPU Lightning turns `precision="16-mixed"` into "bf16-mixed"
    before a strategy sees it; pass `ShardedStrategy(precision_plugin=
    ShardedPrecision("16-mixed"))` to get fp16 there.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"ShardedStrategy does not support precision={precision!r}; use one of "
                             f"{sorted(_PRECISIONS)} (bf16/fp16 models always get fp32 master weights, so there "
                             "is no separate '-true' half mode)")
        self.precision = precision
        self.dtype = _PRECISIONS[precision]
        self.optimizer: ShardedOptimizer | None = None  # set by connect() once the strategy built it

    @property
    def _cast(self) -> bool:
        return self.dtype != torch.float32

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.dtype) if self._cast else module

    def convert_input(self, data: Any) -> Any:
        if not self._cast:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    @contextlib.contextmanager
    def forward_context(self):
        # As Lightning's HalfPrecision: tensors a forward creates (masks, ...)
        # get the model's dtype, so they combine with its activations.
        if not self._cast:
            yield
            return
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def connect(self, model, optimizers, lr_schedulers):
        sharded = [o for o in optimizers if isinstance(o, ShardedOptimizer)]
        self.optimizer = sharded[0] if sharded else None
        return model, optimizers, lr_schedulers

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        # The loss scale is the optimizer's (fp16); scale_loss is the identity otherwise.
        if self.optimizer is not None:
            tensor = self.optimizer.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        _unwrap(optimizer).clip_grad_norm(float(clip_val))

    # clip_grad_by_value is Lightning's own: clip_grad_value_ over the optimizer's parameters, whose
    # .grad act on the shards (Note [Sharded p.grad] in shardopt/sharded_grad.py).

    def teardown(self) -> None:
        self.optimizer = None


def _precision_for(plugin: Optional[Precision]) -> Optional[ShardedPrecision]:
    """The ShardedPrecision standing in for the plugin Lightning chose from `precision=`."""
    if plugin is None or isinstance(plugin, ShardedPrecision):
        return plugin
    if type(plugin) is Precision:
        return ShardedPrecision("32-true")
    if type(plugin) is MixedPrecision:
        return ShardedPrecision(plugin.precision)
    raise ValueError(f"ShardedStrategy cannot use the precision plugin {type(plugin).__name__} (precision="
                     f"{getattr(plugin, 'precision', '?')!r}): use Trainer(precision=...) with one of "
                     f"{sorted(_PRECISIONS)}, or pass ShardedStrategy(precision_plugin=ShardedPrecision(...))")


# -------------------------------------------------------------- optimizers
def _unwrap(optimizer) -> ShardedOptimizer:
    inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if not isinstance(inner, ShardedOptimizer):
        raise TypeError(f"expected the strategy's ShardedOptimizer, got {type(inner).__name__}")
    return inner


def _constructor_kwargs(cls: type, defaults: dict) -> dict:
    """The entries of an optimizer's `defaults` its constructor accepts.

    Some defaults are not constructor arguments (AdamW's decoupled_weight_decay);
    they live on in every param group, which the sharded optimizer copies.
    """
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


# Note [Rebinding LR schedulers]
# configure_optimizers returns a torch optimizer and schedulers built on it:
# at construction a scheduler stored `optimizer`, set "initial_lr" and the
# first scheduled "lr" in its param groups, and wrapped `optimizer.step` to
# notice being stepped before the optimizer. The ShardedOptimizer is built
# from those very param-group dicts (torch.optim.Optimizer keeps the dicts it
# is given), so it starts from the scheduled lr, and any later write to a
# group - by a scheduler, a callback or user code still holding the original
# optimizer - reaches the sharded one too. Schedulers (and those nested in
# SequentialLR / ChainedScheduler) are then pointed at the sharded optimizer,
# since Lightning's LearningRateMonitor and torch's ordering check look at
# `scheduler.optimizer`; the ordering check also wants `step` wrapped, which
# _track_step_for_schedulers redoes for the new optimizer.
def _shard_optimizer(optimizer: torch.optim.Optimizer, options: dict) -> ShardedOptimizer:
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer  # the user built it; their options win
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    cls = type(optimizer)
    return ShardedOptimizer(optimizer.param_groups, optim=cls, **options,
                            **_constructor_kwargs(cls, optimizer.defaults))


def _rebind_schedulers(configs, old: torch.optim.Optimizer, new: ShardedOptimizer) -> None:
    def visit(scheduler):
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
        for inner in getattr(scheduler, "_schedulers", ()):
            visit(inner)

    for config in configs:
        visit(config.scheduler)
    if configs:
        _track_step_for_schedulers(new)


def _track_step_for_schedulers(opt: torch.optim.Optimizer) -> None:
    # torch.optim.lr_scheduler.LRScheduler warns on its first step unless
    # `optimizer.step` carries `_wrapped_by_lr_sched` and has set `_opt_called`.
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        opt._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


def _saved_under(path: str) -> list[str]:
    """The checkpoints a directory holds (save_checkpoint adds one subdirectory per save; hidden ones are partial)."""
    if not os.path.isdir(path):
        return []
    return [e for e in os.listdir(path) if not e.startswith(".") and os.path.isdir(os.path.join(path, e))]


# Note [Lightning's WeightAveraging]
# -----------------------------------
# Lightning's WeightAveraging callback (EMA, SWA) keeps a whole copy of the module and, at each save, puts
# the average in checkpoint["state_dict"] and the current weights in checkpoint["current_model_state"]; on
# resume it reads both (the average into its copy, the current weights into the module). A sharded
# checkpoint holds the current weights already, as the optimizer's masters (fp32 for a bf16 model), so the
# average is kept whole in `extra` (rank 0 writes it, as Lightning would) and the current weights are not
# stored twice: a marker says they are the checkpoint's weights, and loading hands the callback the
# module's values after the load. Read outside fit (validate, test, predict) the checkpoint's state_dict
# is the average, as with Lightning's own strategies.
_AVERAGED = "current_model_state"
_CURRENT_IS_THE_WEIGHTS = "shardopt: the checkpoint's weights"


def _refuse_weight_averaging(trainer: "pl.Trainer") -> None:
    """At stage 3: the averaging callbacks read whole weights outside a forward, and a parameter is empty between
    uses (Lightning's StochasticWeightAveraging refuses FSDP and DeepSpeed for the same reason)."""
    from lightning.pytorch import callbacks

    names = ("WeightAveraging", "StochasticWeightAveraging")
    kinds = tuple(getattr(callbacks, n) for n in names if hasattr(callbacks, n))
    found = [type(c).__name__ for c in trainer.callbacks if isinstance(c, kinds)]
    if found:
        raise ValueError(f"Lightning's {found[0]} callback cannot average a ShardedStrategy(stage=3) model: it "
                         "keeps a whole copy of the model and reads every weight outside a forward, while at "
                         "stage 3 a parameter is empty between uses. Use stage=1 or 2 with it (each rank then holds "
                         "the weights anyway), or keep an average yourself inside opt.full_params()")


# Note [Averages of a cast model]
# --------------------------------
# Lightning's WeightAveraging copies the module in its setup hook, before the strategy's setup casts the module
# for "bf16-mixed" / "16-mixed" (ShardedPrecision: a bf16/fp16 model, fp32 masters). Its average stays fp32
# while the module it averages is bf16, and torch's AveragedModel.update_parameters takes pairs of mixed dtypes
# only where it averages tensor by tensor: its foreach path, the default average on CUDA and any multi_avg_fn
# (get_ema_multi_avg_fn) on any device, raises ("Tensors of the same index must be on the same device and the
# same dtype" on an H100; "expected dtype float for `end`" from _foreach_lerp_ on the CPU). So an average whose
# dtypes differ from the module's is given the module's tensors in its own dtypes, one temporary copy per
# update: the weights the model holds, upcast (DDP averages its fp32 weights; a sharded bf16 model has fp32
# values only as each rank's shard of the masters).
class _InDtypesOf:
    """A module's parameters and buffers in another module's dtypes, as AveragedModel.update_parameters reads them."""

    def __init__(self, module: nn.Module, like: nn.Module):
        self.module, self.like = module, like

    def parameters(self):
        return (p.detach().to(a.dtype) for p, a in zip(self.module.parameters(), self.like.parameters()))

    def buffers(self):
        return (b.detach().to(a.dtype) for b, a in zip(self.module.buffers(), self.like.buffers()))


def _average_in_own_dtypes(trainer: "pl.Trainer", module: nn.Module) -> None:
    """Note [Averages of a cast model]: after the module is cast, before the first update."""
    from torch.optim.swa_utils import AveragedModel

    dtypes = [t.dtype for t in itertools.chain(module.parameters(), module.buffers())]
    for callback in trainer.callbacks:
        average = getattr(callback, "_average_model", None)
        if not isinstance(average, AveragedModel) or "update_parameters" in vars(average):
            continue
        own = [t.dtype for t in itertools.chain(average.module.parameters(), average.module.buffers())]
        if own != dtypes:
            update = type(average).update_parameters
            average.update_parameters = lambda model, _a=average: update(_a, _InDtypesOf(model, _a.module))


# Note [Weights-only saves at stage 3]
# ------------------------------------
# ModelCheckpoint(save_weights_only=True) (or trainer.save_checkpoint(path, weights_only=True)) during a
# stage-3 fit: Lightning's file is one torch.save pickle of a dict whose "state_dict" holds every tensor
# (load_from_checkpoint and torch.load read it so), and its API hands the strategy that dict to write through
# its CheckpointIO. So a whole state-dict object must exist on the rank that writes; what can be streamed is:
#   * the gather: every rank walks the parameters bucket by bucket (as save_weights does: Note [A state dict
#     on rank 0, streamed and spilled] in shardopt/weights/rank0.py), and only rank 0 keeps the values. Other
#     ranks hold one bucket beyond their shard (this used to be module.state_dict(), which gathers every
#     bucket at once and copies the whole model, on every rank);
#   * rank 0's copy: each value goes into an unlinked scratch file beside the checkpoint and is mapped back,
#     so the dict's tensors are file pages (read in as torch.save reads them, droppable), not anonymous
#     memory;
#   * the file: with Lightning's default TorchCheckpointIO and a local path, torch.save writes the file
#     directly (temporary name, fsync, rename: as atomic as Lightning's own), because TorchCheckpointIO's
#     _atomic_save serialises the whole checkpoint into an in-memory BytesIO and then copies it out
#     (getvalue): twice the model in memory. A custom CheckpointIO (or a remote path, or storage_options)
#     gets the dict as Lightning gives it and holds what it holds.
# What cannot be streamed: the dict itself (one pickle, written by whoever Lightning's API names), and the
# model's size of disk for the scratch file while the save runs. A folder of whole weights that no rank holds
# at all is shardopt.save_weights(trainer.strategy.model, "folder") on every rank, or `shardopt convert` of
# the sharded checkpoint.
def _plain_local_path(filepath) -> str | None:
    """`filepath` if it names a local file without a protocol (the strategy writes those itself), else None."""
    path = os.fspath(filepath)
    return path if isinstance(path, str) and "://" not in path else None


# Modules ShardedDDP has hooked: its gradient hooks stay while that wrapper
# lives, and the finished Trainer may still hold it, so a second wrap would
# reduce every gradient twice (see _setup_model).
_WRAPPED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


# ------------------------------------------------------------------ strategy
class ShardedStrategy(DDPStrategy):
    """ZeRO-1/2/3 data parallel training: `Trainer(strategy="shardopt")` or `Trainer(strategy=ShardedStrategy(...))`.

    Args:
        stage, offload, reduce_bucket_size, allgather_bucket_size, overlap_comm:
            as ShardedOptimizer's (bucket sizes in elements; None: automatic).
        broadcast_buffers: ShardedDDP's: re-broadcast buffers from rank 0 before
            each forward that reduces gradients, as DDP does.
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
        precision_plugin, process_group_backend, timeout, start_method:
            as Lightning's DDPStrategy ("popen" relaunches the script, "spawn"
            starts processes from the Trainer).
        whole_weights_after_fit: at stage 3, whether fit's end gathers the
            whole weights into the module on every rank (True: a plain module
            afterwards, as after DDP) or leaves it sharded, for a model too big
            for one rank (Note [Lightning at stage 3]).
        **more: further ShardedOptimizer options (num_staging_buffers,
            comm_impl, and whatever else the installed version has).

    Only one optimizer (from configure_optimizers) is supported; it may be any
    elementwise torch optimizer and keeps its param groups and LR schedulers.
    """

    strategy_name = "shardopt"

    def __init__(self, stage: int = 2, offload: str = "none", reduce_bucket_size: int | None = None,
                 allgather_bucket_size: int | None = None, overlap_comm: bool = True,
                 broadcast_buffers: bool = True, accelerator=None, parallel_devices=None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", config=None, whole_weights_after_fit: bool = True,
                 **more: Any) -> None:
        options = dict(stage=stage, offload=offload, reduce_bucket_size=reduce_bucket_size,
                       allgather_bucket_size=allgather_bucket_size, overlap_comm=overlap_comm, **more)
        # A DeepSpeed config (as DeepSpeedStrategy(config=...) takes): its zero_optimization etc. win over
        # the defaults above, and an "optimizer" block (with "scheduler") replaces configure_optimizers'.
        self.ds_config = None
        if config is not None:
            from shardopt.deepspeed_config import load_config, translate
            self.ds_config = load_config(config)
            options.update(translate(self.ds_config).kwargs)
            options.pop("loss_scale", None)  # the precision plugin's; from_config reads the config again
        unknown = sorted(set(options) - _optimizer_options())
        if unknown:
            raise TypeError(f"ShardedStrategy got unknown options {unknown}; it accepts "
                            f"{sorted(_optimizer_options() | {'broadcast_buffers'})} and DDPStrategy's "
                            "launch arguments")
        # Validate now (at Trainer construction) rather than after processes start.
        fields = {f.name for f in dataclasses.fields(ShardConfig)}
        ShardConfig(**{k: v for k, v in options.items() if k in fields})
        for name, value in (("broadcast_buffers", broadcast_buffers),
                            ("whole_weights_after_fit", whole_weights_after_fit)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.optimizer_options = options
        self.broadcast_buffers = broadcast_buffers
        self.whole_weights_after_fit = whole_weights_after_fit
        self._restored_sharded = False  # the last load_checkpoint read shardopt's format

    # ---------------------------------------------------------- precision
    @property
    def precision_plugin(self) -> Precision:
        # Not stored when unset: Lightning reads `_precision_plugin` to tell a
        # plugin the user gave the strategy from none (then `precision=` wins).
        return self._precision_plugin if self._precision_plugin is not None else ShardedPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning builds its own plugin from `precision=` and hands it to the
        # strategy; ours replaces it (it has no hook to choose one itself).
        self._precision_plugin = _precision_for(plugin)

    # --------------------------------------------------------------- setup
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            if self.lightning_module in _WRAPPED:
                raise RuntimeError(f"ShardedStrategy already trained this {type(self.lightning_module).__name__} "
                                   "instance: its parameters keep the gradient hooks of that run, so fitting it "
                                   "again would reduce every gradient twice. Create a new LightningModule for each "
                                   "fit (load the weights, or pass ckpt_path= to continue)")
            if self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
        # Cast before the optimizer exists: it is built on the model's final parameters.
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            if self._sharded_optimizer().params_sharded:
                _refuse_weight_averaging(trainer)
            _average_in_own_dtypes(trainer, self.lightning_module)
            self.model = self._setup_model(self.model)
        elif self._stage3_wrapper() is not None:
            # The module stayed sharded after fit (whole_weights_after_fit=False): validate/test/predict steps
            # go through its wrapper, as in fit, whose forward opens and closes each pass of gathers.
            self.model = self._stage3_wrapper()
        else:
            _sync_module_states(self.model)  # no wrapper, so broadcast rank 0's weights as DDP does
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"ShardedStrategy trains with exactly one optimizer, but configure_optimizers "
                             f"returned {len(self.optimizers)}: put all parameters in one optimizer (use "
                             "param groups for different hyper-parameters)")
        old = self.optimizers[0]
        if self.ds_config is not None and "optimizer" in self.ds_config:
            self._optimizer_from_config()
            return
        sharded = _shard_optimizer(old, self.optimizer_options)
        _rebind_schedulers(self.lr_scheduler_configs, old, sharded)
        self.optimizers = [sharded]

    def _optimizer_from_config(self) -> None:
        """The DeepSpeed config's optimizer (and WarmupLR, stepped every step as DeepSpeed's engine does)
        replaces what configure_optimizers returned, as with DeepSpeedStrategy."""
        from lightning.pytorch.utilities.types import LRSchedulerConfig

        config = dict(self.ds_config)
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        dtype = params[0].dtype if params else torch.float32
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype)
        if name is not None and name not in config:  # the Trainer's precision= casts the model (as Lightning
            config[name] = {"enabled": True}         # writes it into DeepSpeed's config)
        sharded = ShardedOptimizer.from_config(params, config)
        self.optimizers = [sharded]
        self.lr_scheduler_configs = []
        if sharded.lr_scheduler is not None:
            self.lr_scheduler_configs = [LRSchedulerConfig(sharded.lr_scheduler, interval="step")]
            _track_step_for_schedulers(sharded)

    def _setup_model(self, model: nn.Module) -> ShardedDDP:
        wrapped = ShardedDDP(model, self._sharded_optimizer(), broadcast_buffers=self.broadcast_buffers)
        _WRAPPED.add(self.lightning_module)
        return wrapped

    def _fitting(self) -> bool:
        return self.lightning_module.trainer.state.fn == TrainerFn.FITTING

    def _sharded_optimizer(self) -> ShardedOptimizer:
        return _unwrap(self.optimizers[0])

    def optimizer_step(self, optimizer, closure, model=None, **kwargs) -> Any:
        trainer = self.lightning_module.trainer
        if trainer is not None and getattr(trainer.fit_loop, "_skip_backward", False):
            # Lightning's StochasticWeightAveraging ends with one epoch of forwards that recompute BatchNorm's
            # statistics for the average, backward skipped, and one optimizer step at its end that the callback
            # means as none ("no need to perform either backward or optimizer.step"). Under DDP that step
            # applies the gradients the previous epoch left (Lightning zeroes them at the start of an
            # accumulation window, which this epoch skips) and moves the weights off the average. ShardedOptimizer
            # refuses a step with no backward on any rank (a bug anywhere else): here the step is not taken, the
            # forwards still run, and the module ends at the average (tests/test_lightning.py).
            return closure()
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        if isinstance(self.model, ShardedDDP):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def optimizer_state(self, optimizer) -> dict:
        # The sharded checkpoint holds the optimizer state; nothing to gather here.
        return {}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Lightning asks every rank for the weights before each save. At stage 3 that would gather the whole
        # model on every rank: the sharded checkpoint holds the weights, and a weights-only save gathers
        # them itself (save_checkpoint). Note [Lightning at stage 3].
        if self._stage3_attached():
            return {}
        return super().lightning_module_state_dict()

    def _stage3_attached(self) -> bool:
        return self._stage3_wrapper() is not None

    def _stage3_wrapper(self) -> ShardedDDP | None:
        """The stage-3 wrapper of the module: during fit, or kept after it (whole_weights_after_fit=False)."""
        wrapper = self.model if isinstance(self.model, ShardedDDP) else shardopt.wrapper_of(self.lightning_module)
        return wrapper if wrapper is not None and wrapper.optimizer.params_sharded else None

    def teardown(self) -> None:
        if isinstance(self.model, ShardedDDP):
            wrapper, self.model = self.model, self.lightning_module
            if self.lightning_module.__dict__.get("_shardopt_wrapper") is wrapper:
                pass  # validate/test/predict after a fit that left the module sharded: it stays so
            elif not wrapper.optimizer.params_sharded:
                # Stages 1-2: Lightning's teardown moves the module to the CPU, gradients too, and a reduced
                # p.grad is this rank's shard only (Note [Sharded p.grad]): it cannot move. The wrapper lets
                # go of the module first (hooks off; those p.grad None), as DDP leaves a plain module. On a
                # GPU, without this, every fit ended in an error here (first seen on an H200, 2026-11-26).
                wrapper.detach()
            else:
                trainer = self.lightning_module.trainer
                if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
                    warnings.warn("fit was interrupted: the LightningModule's parameters stay sharded (empty on "
                                  "every rank); load the last checkpoint to use them", UserWarning, stacklevel=2)
                elif self.whole_weights_after_fit:
                    wrapper.detach()  # whole weights again, on every rank (Note [Lightning at stage 3])
                else:
                    # Sharded from now on: the module keeps its wrapper alive (outside nn.Module's registry, so
                    # it is no submodule), and shardopt.wrapper_of(module) finds it (Note [Lightning at stage 3]).
                    self.lightning_module.__dict__["_shardopt_wrapper"] = wrapper
        super().teardown()

    # ---------------------------------------------------------- checkpoints
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        """Writes shardopt's sharded checkpoint: a directory at `filepath`, every rank writing its own part.

        The weights (fp32 master values) and the optimizer state go in
        shardopt's format, loadable at any world size; everything else
        Lightning saves (loops, callbacks, LR schedulers, hyper-parameters) goes
        in as its `extra`. Saving to a path again replaces what it held, as
        Lightning expects. Weights-only saves (and saves outside fit) are
        Lightning's usual single file: every rank holds the full weights.
        """
        if "optimizer_states" not in checkpoint or not self.optimizers:
            if self._stage3_attached() and not checkpoint.get("state_dict"):
                return self._save_weights_only(checkpoint, filepath, storage_options)
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("ShardedStrategy writes shardopt's checkpoint format and takes no storage_options")
        filepath = self.broadcast(os.fspath(filepath))  # ranks may format names differently
        older = _saved_under(filepath) if self.is_global_zero else []
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if _AVERAGED in checkpoint:  # Note [Lightning's WeightAveraging]
            extra.update({"state_dict": checkpoint["state_dict"], _AVERAGED: _CURRENT_IS_THE_WEIGHTS})
        saved = shardopt.save_checkpoint(filepath, self.lightning_module, self._sharded_optimizer(), extra=extra)
        if self.is_global_zero:
            for entry in older:
                if entry != os.path.basename(os.path.normpath(saved)):
                    shutil.rmtree(os.path.join(filepath, entry), ignore_errors=True)

    def _save_weights_only(self, checkpoint: dict, filepath, storage_options: Any) -> None:
        """A weights-only save during a stage-3 fit (every rank is here): Note [Weights-only saves at stage 3]."""
        local = _plain_local_path(filepath)
        folder = os.path.dirname(os.path.abspath(local)) if local is not None else None
        # The scratch file beside the checkpoint (its disk), else in the system's temporary folder.
        state = state_dict_on_rank0(self._stage3_wrapper(), folder if folder is not None and os.path.isdir(folder) else None)
        if not self.is_global_zero:
            return
        checkpoint["state_dict"] = state
        if local is not None and storage_options is None and type(self.checkpoint_io) is TorchCheckpointIO:
            torch_save_atomic(checkpoint, local)  # TorchCheckpointIO's file, without its in-memory copy
        else:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        """Reads a sharded checkpoint directory (saved at any world size), or a plain Lightning checkpoint file."""
        self._restored_sharded = False
        if not os.path.isdir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # Lightning's effective default for local files (torch.load's).
        weights_only = True if weights_only is None else weights_only
        path = os.fspath(checkpoint_path)
        if not self._fitting():
            # Not fitting: no optimizer to load into, so read the whole model
            # state and let Lightning load it as from a plain checkpoint.
            from shardopt.checkpoint.convert import checkpoint_to_torch

            full = checkpoint_to_torch(path, weights_only=weights_only)
            extra = full["extra"] or {}
            if extra.get(_AVERAGED) == _CURRENT_IS_THE_WEIGHTS:  # the average is the state_dict, as saved
                return {**extra, _AVERAGED: full["model"]}
            return {**extra, "state_dict": full["model"]}
        extra = shardopt.load_checkpoint(path, self.lightning_module, self._sharded_optimizer(),
                                         weights_only=weights_only)
        self._restored_sharded = True
        if extra is not None and extra.get(_AVERAGED) == _CURRENT_IS_THE_WEIGHTS:
            # The callback loads these back into the module: the values it holds now, so that a bf16 model's
            # fp32 masters stay as loaded (Note [A load of the values held] in shardopt/ddp.py).
            extra[_AVERAGED] = self.lightning_module.state_dict()
        return extra

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer a checkpoint loads into exists only after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._restored_sharded  # a sharded checkpoint restored it already

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if self._restored_sharded:
            return  # load_checkpoint put the weights in place
        # A plain checkpoint (e.g. from "ddp"): the module's load hooks give the masters the saved values, fp32
        # ones at fp32 (Note [A load of the values held] in shardopt/ddp.py).
        super().load_model_state_dict(checkpoint, strict=strict)

    # ---------------------------------------------------------- registry
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        entries = (
            ("shardopt", "ZeRO-2 with shardopt (ShardedOptimizer + ShardedDDP)", {}),
            ("shardopt_stage_1", "shardopt ZeRO-1: optimizer state sharded", {"stage": 1}),
            ("shardopt_stage_3", "shardopt ZeRO-3: parameters sharded too", {"stage": 3}),
            ("shardopt_offload", "shardopt ZeRO-2 with optimizer state and fp32 master weights on the CPU",
             {"offload": "cpu"}),
            ("shardopt_spawn", "shardopt ZeRO-2, processes started with start_method='spawn'",
             {"start_method": "spawn"}),
        )
        for name, description, params in entries:
            strategy_registry.register(name, cls, description=description, override=True, **params)


ShardedStrategy.register_strategies(StrategyRegistry)

__all__ = ["ShardedPrecision", "ShardedStrategy"]
