"""PyTorch Lightning strategy: `Trainer(strategy="shardopt")` trains with ShardedOptimizer + ShardedDDP.

    import shardopt.integrations.lightning            # registers "shardopt" (and variants) with Lightning
    trainer = lightning.Trainer(strategy="shardopt", devices=2, precision="bf16-mixed")
    trainer = lightning.Trainer(strategy=ShardedStrategy(stage=1, reduce_bucket_size=int(5e7)))

On top of DDPStrategy: the optimizer is rebuilt as a ShardedOptimizer (Note [Rebinding LR schedulers]),
the module wrapped in ShardedDDP, precision is ShardedPrecision's, and `trainer.save_checkpoint(path)`
writes shardopt's sharded checkpoint, which `fit(ckpt_path=...)` loads at any number of devices.

Note [Lightning at stage 3]
---------------------------
During fit a stage-3 module's parameters are empty between uses and every step gathers through the
wrapper's hooks on every rank. The weights Lightning reads on every rank before each save
(lightning_module_state_dict) are left out: the sharded checkpoint holds them, and a weights-only save
gathers them onto rank 0 (Note [Weights-only saves at stage 3]). When fit ends the module gets its whole
weights back on every rank (ShardedDDP.detach()), a plain module as after DDP (a fit that raised leaves it
sharded, with a warning). whole_weights_after_fit=False keeps it sharded, held by its wrapper
(shardopt.wrapper_of(module)), whose hooks serve validate/test/predict and weights-only saves.
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
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
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

_OWN_OPTIMIZER_ARGS = ("params", "optim", "process_group")


def _optimizer_options() -> set[str]:
    """ShardedOptimizer's keyword-only options (stage, bucket sizes, offload, loss scaling, ...)."""
    sig = inspect.signature(ShardedOptimizer.__init__).parameters
    return {n for n, p in sig.items() if p.kind is p.KEYWORD_ONLY and n not in _OWN_OPTIMIZER_ARGS}


_PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ShardedPrecision(Precision):
    """The module and floating-point inputs cast to bf16 / fp16 ("bf16-mixed" / "16-mixed", no autocast),
    fp32 master weights in the optimizer, as DeepSpeed's modes. On CPU Lightning turns "16-mixed" into
    "bf16-mixed": pass `ShardedStrategy(precision_plugin=ShardedPrecision("16-mixed"))` for fp16 there."""

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
        # As Lightning's HalfPrecision: tensors a forward creates (masks, ...) get the model's dtype.
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
        if self.optimizer is not None:
            tensor = self.optimizer.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        _unwrap(optimizer).clip_grad_norm(float(clip_val))

    # clip_grad_by_value is Lightning's own: the parameters' .grad are the shards (Note [Sharded p.grad]).

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


def _unwrap(optimizer) -> ShardedOptimizer:
    inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if not isinstance(inner, ShardedOptimizer):
        raise TypeError(f"expected the strategy's ShardedOptimizer, got {type(inner).__name__}")
    return inner


def _constructor_kwargs(cls: type, defaults: dict) -> dict:
    """The entries of an optimizer's `defaults` its constructor accepts (the others, such as AdamW's
    decoupled_weight_decay, live on in the param groups the sharded optimizer copies)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


# Note [Rebinding LR schedulers]
# The ShardedOptimizer is built from the very param-group dicts the schedulers wrote "initial_lr" and "lr"
# into (torch.optim keeps the dicts it is given), so every write to a group reaches it. The schedulers,
# nested ones too, are pointed at it (LearningRateMonitor reads `scheduler.optimizer`), and its `step` is
# wrapped as torch's ordering check expects.
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
    # LRScheduler warns on its first step unless `optimizer.step` has `_wrapped_by_lr_sched` and set `_opt_called`.
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


# Note [Lightning's AsyncCheckpointIO]
# -------------------------------------
# With `Trainer(plugins=[AsyncCheckpointIO()])` a sharded checkpoint saved while a fit runs is saved with
# blocking=False: each rank's part is staged and the call returns (Note [Checkpoints written behind training] in
# checkpoint/background.py). The save is waited for at the next save, a load and teardown (as AsyncCheckpointIO's
# own thread is), which raise its failure; only then are the checkpoints it replaces under the same path
# removed. Outside a fit nothing would wait for it: such saves block.

# Note [Lightning's WeightAveraging]
# -----------------------------------
# The WeightAveraging callback (EMA, SWA) saves the average as "state_dict" and the current weights as
# "current_model_state". A sharded checkpoint holds the current weights already, so the average goes whole
# into `extra` and a marker stands for them; a load hands the callback the module's values after it.
_AVERAGED = "current_model_state"
_CURRENT_IS_THE_WEIGHTS = "shardopt: the checkpoint's weights"


def _refuse_weight_averaging(trainer: "pl.Trainer") -> None:
    """At stage 3 the averaging callbacks would read empty parameters (SWA refuses FSDP and DeepSpeed so)."""
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
# WeightAveraging copies the module before the strategy casts it, so its average stays fp32 beside a bf16
# module, and AveragedModel.update_parameters' foreach path raises on mixed dtypes: such an average is
# given the module's tensors upcast to its own dtypes, a temporary copy per update.
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
# Lightning's weights-only file is one pickled dict of every tensor, so the dict must exist on rank 0. The
# gather streams (only rank 0 keeps the values: Note [A state dict on rank 0, streamed and spilled] in
# shardopt/weights/rank0.py), the values live in an unlinked scratch file beside the checkpoint, mapped
# back, and with the default TorchCheckpointIO and a local path torch.save writes the file directly
# (TorchCheckpointIO would serialise it into a BytesIO first: twice the model in memory).
def _plain_local_path(filepath) -> str | None:
    """`filepath` if it names a local file without a protocol (the strategy writes those itself), else None."""
    path = os.fspath(filepath)
    return path if isinstance(path, str) and "://" not in path else None


# Modules ShardedDDP hooked (the finished Trainer may hold the wrapper): a second wrap would reduce twice.
_WRAPPED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class ShardedStrategy(DDPStrategy):
    """ZeRO-1/2/3 data parallel training: `Trainer(strategy="shardopt")` or `Trainer(strategy=ShardedStrategy(...))`.

    Args:
        stage, offload, reduce_bucket_size, allgather_bucket_size, overlap_comm: as ShardedOptimizer's.
        broadcast_buffers: ShardedDDP's (buffers from rank 0 before each forward, as DDP).
        accelerator, ..., start_method: as Lightning's DDPStrategy ("popen" relaunches the script).
        config: a DeepSpeed config, as DeepSpeedStrategy(config=...) takes.
        whole_weights_after_fit: at stage 3, whether fit's end gathers the whole weights into the module
            on every rank (Note [Lightning at stage 3]). **more: further ShardedOptimizer options.
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
        # A DeepSpeed config's settings win over the defaults; its "optimizer" replaces configure_optimizers'.
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
        self._saving = None  # with AsyncCheckpointIO: (the save in flight, its path, the entries it replaces)

    @property
    def precision_plugin(self) -> Precision:
        # Unset stays None: Lightning reads `_precision_plugin` to tell a user's plugin from none.
        return self._precision_plugin if self._precision_plugin is not None else ShardedPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = _precision_for(plugin)

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
            # Sharded after fit (whole_weights_after_fit=False): steps go through its wrapper, as in fit.
            self.model = self._stage3_wrapper()
        else:
            _sync_module_states(self.model)  # no wrapper, so broadcast rank 0's weights as DDP does
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        if any(p.is_meta for p in self.model.parameters()):
            return  # configure_model built it on the meta device: ShardedDDP gives it values shard by shard
        super().model_to_device()

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
        """The DeepSpeed config's optimizer (and scheduler, stepped every step) replaces configure_optimizers'."""
        from lightning.pytorch.utilities.types import LRSchedulerConfig

        config = dict(self.ds_config)
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        dtype = params[0].dtype if params else torch.float32
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype)
        if name is not None and name not in config:  # the model was cast by precision=, as Lightning writes it
            config[name] = {"enabled": True}
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
            # StochasticWeightAveraging's last epoch recomputes BatchNorm's statistics with backward skipped;
            # its optimizer step is meant as none (under DDP it would apply stale gradients), and
            # ShardedOptimizer refuses a step without backward: the forwards run, the step is not taken.
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
        return {}  # the sharded checkpoint holds it

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Note [Lightning at stage 3]: not gathered on every rank before each save.
        if self._stage3_attached():
            return {}
        return super().lightning_module_state_dict()

    def _stage3_attached(self) -> bool:
        return self._stage3_wrapper() is not None

    def _stage3_wrapper(self) -> ShardedDDP | None:
        wrapper = self.model if isinstance(self.model, ShardedDDP) else shardopt.wrapper_of(self.lightning_module)
        return wrapper if wrapper is not None and wrapper.optimizer.params_sharded else None

    def teardown(self) -> None:
        self._finish_save()
        if isinstance(self.model, ShardedDDP):
            wrapper, self.model = self.model, self.lightning_module
            if self.lightning_module.__dict__.get("_shardopt_wrapper") is wrapper:
                pass  # validate/test/predict after a fit that left the module sharded: it stays so
            elif not wrapper.optimizer.params_sharded:
                # Stages 1-2: Lightning's teardown moves the module to the CPU with its gradients, and a
                # reduced p.grad is a shard (Note [Sharded p.grad]) that cannot move: the wrapper lets go of
                # the module first (hooks off, those p.grad None), as DDP leaves a plain module.
                wrapper.detach()
            else:
                trainer = self.lightning_module.trainer
                if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
                    warnings.warn("fit was interrupted: the LightningModule's parameters stay sharded (empty on "
                                  "every rank); load the last checkpoint to use them", UserWarning, stacklevel=2)
                elif self.whole_weights_after_fit:
                    wrapper.detach()  # whole weights again, on every rank (Note [Lightning at stage 3])
                else:
                    # Held outside nn.Module's registry (no submodule), for shardopt.wrapper_of(module).
                    self.lightning_module.__dict__["_shardopt_wrapper"] = wrapper
        super().teardown()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        """Writes shardopt's sharded checkpoint: a directory at `filepath`, every rank writing its own part.

        Weights and optimizer state go in shardopt's format (any world size loads it), the rest Lightning
        saves in its `extra`; saving to a path again replaces it. Weights-only saves (and saves outside fit)
        are Lightning's usual single file.
        """
        if "optimizer_states" not in checkpoint or not self.optimizers:
            if self._stage3_attached() and not checkpoint.get("state_dict"):
                return self._save_weights_only(checkpoint, filepath, storage_options)
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("ShardedStrategy writes shardopt's checkpoint format and takes no storage_options")
        filepath = self.broadcast(os.fspath(filepath))  # ranks may format names differently
        self._finish_save()  # first: a save in flight to the same path is one of the entries this one replaces
        older = _saved_under(filepath) if self.is_global_zero else []
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if _AVERAGED in checkpoint:  # Note [Lightning's WeightAveraging]
            extra.update({"state_dict": checkpoint["state_dict"], _AVERAGED: _CURRENT_IS_THE_WEIGHTS})
        # Note [Lightning's AsyncCheckpointIO]: written behind training, the entries it replaces removed after.
        trainer = self.lightning_module.trainer
        behind = isinstance(self.checkpoint_io, AsyncCheckpointIO) and trainer is not None and \
            trainer.state.status == TrainerStatus.RUNNING  # teardown waits for it
        saved = shardopt.save_checkpoint(filepath, self.lightning_module, self._sharded_optimizer(), extra=extra,
                                         blocking=not behind)
        if behind:
            self._saving = (saved, filepath, older)
        else:
            self._replace(filepath, older, saved)

    def _replace(self, filepath: str, older: list, saved: str) -> None:
        if self.is_global_zero:
            for entry in older:
                if entry != os.path.basename(os.path.normpath(saved)):
                    shutil.rmtree(os.path.join(filepath, entry), ignore_errors=True)

    def _finish_save(self) -> None:
        """The sharded save in flight (AsyncCheckpointIO), waited for: its failure raised, what it replaces removed."""
        if self._saving is not None:
            handle, filepath, older = self._saving
            self._saving = None
            self._replace(filepath, older, handle.result())

    def _save_weights_only(self, checkpoint: dict, filepath, storage_options: Any) -> None:
        """A weights-only save during a stage-3 fit (every rank is here): Note [Weights-only saves at stage 3]."""
        local = _plain_local_path(filepath)
        folder = os.path.dirname(os.path.abspath(local)) if local is not None else None
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
        self._finish_save()
        if not os.path.isdir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        weights_only = True if weights_only is None else weights_only  # torch.load's default, as Lightning's
        path = os.fspath(checkpoint_path)
        if not self._fitting():
            # No optimizer to load into: the whole model state, loaded by Lightning as a plain checkpoint.
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
            # The callback loads them back: the values held now (Note [A load of the values held] in ddp.py).
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
        # A plain checkpoint: the module's load hooks set the masters (Note [A load of the values held]).
        super().load_model_state_dict(checkpoint, strict=strict)

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
