"""DeepSpeed JSON config -> ShardedOptimizer arguments (pure translation, no process group).

`ShardedOptimizer.from_config(params, config)` calls `optimizer_arguments`. Each key means what DeepSpeed
0.19 does with it (its runtime/config.py, engine.py and zero/), so a run moved from DeepSpeed trains the
same way; docs/checkpoints-and-migration.md lists every key's fate for users.

Note [DeepSpeed keys: translated, accepted, refused]
----------------------------------------------------
Every key is translated, accepted without effect, or refused, and all refusals come in one error (a user
fixing a config should not meet its problems one run at a time):
* translated: `zero_optimization` (stage, bucket sizes, overlap_comm, Note [DeepSpeed's stage-3 keys]; the
  offload blocks and "aio": Note [DeepSpeed's offload keys] in deepspeed_offload.py), `optimizer`,
  `gradient_clipping`, `fp16`, `bf16`, `communication_data_type`, `scheduler` (WarmupLR);
* accepted without effect (`Translation.ignored`, said in one line at construction): keys shardopt's
  behaviour makes moot (`contiguous_gradients`: gradients are always in one flat buffer), DeepSpeed's own
  bookkeeping, stage-3 keys below stage 3 (DeepSpeed ignores them too), and the training loop's batch
  keys: shardopt owns neither the loader nor the loss, so `gradient_accumulation_steps > 1` warns, naming
  what the loop must do instead;
* refused: a name DeepSpeed itself refuses (its zero_optimization, offload, fp16 and bf16 models forbid
  extra keys: a typo, named with the nearest valid name, or a removed feature), a value shardopt cannot
  honour, and "auto" (only the Hugging Face integration fills it in).

Note [DeepSpeed defaults that change results]
---------------------------------------------
An absent key takes DeepSpeed's default where that changes the numbers: `gradient_clipping` clips at 1.0
(GRADIENT_CLIPPING_DEFAULT; say 0 for none); "Adam" is AdamW (`adam_w_mode` defaults to true);
`weight_decay` is 0.0 (DeepSpeed's FusedAdam and CPUAdam; torch's own with `"torch_adam": true`); with
fp16/bf16 gradients are reduced in that dtype unless `communication_data_type` says "fp32". Bucket sizes
and overlap_comm change only speed and memory: absent, shardopt's defaults apply (Note [Default bucket
sizes] in config.py), not DeepSpeed's single 5e8-element bucket.

Note [DeepSpeed's stage-3 keys]
-------------------------------
DeepSpeed reads them at stage 3 only; below it they are accepted and ignored, as DeepSpeed does.
stage3_prefetch_bucket_size, stage3_max_live_parameters and stage3_param_persistence_threshold are
ShardedOptimizer's options of those names, in elements; stage3_allgather_sequential = true means no
prefetch. Without effect: stage3_max_reuse_distance (the schedule keeps a bucket until the last module of
the pass that waits for it, DeepSpeed's behaviour at its default 1e9; a smaller distance only frees
earlier), allgather_bucket_size (the gather unit is reduce_bucket_size) and leaf_module (how DeepSpeed's
hooks fetch). stage3_gather_16bit_weights_on_model_save is for trainers that save models
(`Translation.gather_weights_on_save`). offload_param is a tier (Note [DeepSpeed's offload keys]). Keys whose only value shardopt can honour is DeepSpeed's default
(stage3_model_persistence_threshold, stage3_module_granularity_threshold, ...) are refused at any other.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import logging
import os
import sys
import warnings
from typing import Any

import torch

from shardopt.deepspeed_offload import (DS_AIO_KEYS, DS_OFFLOAD_OPTIMIZER_KEYS, DS_OFFLOAD_PARAM_KEYS,  # noqa: F401
                                        Offload, finish, read_aio, read_block)

logger = logging.getLogger("shardopt")

# DeepSpeed 0.19.8's names: field names and aliases of DeepSpeedZeroConfig (runtime/zero/config.py) and of the
# offload models (runtime/zero/offload_config.py), all pydantic with extra="forbid". tests/test_ds_config.py
# compares them with the installed DeepSpeed's.
DS_ZERO_KEYS = frozenset({
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm", "load_from_fp32_weights",
    "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
    "max_reuse_distance", "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients", "parameter_alignment", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory", "leaf_module"})
DS_FP16_KEYS = frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                          "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"})
DS_BF16_KEYS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                          "bf16_optimizer_states"})  # runtime/precision_config.py
_REMOVED_ZERO_KEYS = {  # DeepSpeed's own message for them: runtime/config.py _REMOVED_ZERO_CONFIG_KEYS
    "mics_shard_size": "MiCS was removed from DeepSpeed and shardopt has none; to shard inside a node and "
                       "replicate across nodes pass shard_group='node' (or mesh=...) to from_config",
    "mics_hierarchical_params_gather": "MiCS was removed from DeepSpeed and shardopt has none",
    "zeropp_loco_param": "LoCo-ZeRO++ was removed from DeepSpeed and shardopt has none",
}

_TOP_NO_EFFECT = {
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "prescale_gradients",
}
_LOOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_ZERO_NO_EFFECT = {
    "contiguous_gradients", "ignore_unused_parameters", "round_robin_gradients", "elastic_checkpoint",
    "load_from_fp32_weights", "sub_group_size", "use_multi_rank_bucket_allreduce", "enable_sanity_checks",
    "pipeline_loading_checkpoint", "save_muon_momentum_buffer_in_memory",
    # DeepSpeed's stage-3 machinery (its linear autograd function, its Module.apply patch, trace-cache logs)
    "memory_efficient_linear", "override_module_apply", "log_trace_cache_warnings",
}
_STAGE3_SIZES = {"stage3_prefetch_bucket_size": "prefetch_bucket_size", "prefetch_bucket_size": "prefetch_bucket_size",
                 "stage3_max_live_parameters": "max_live_parameters", "max_live_parameters": "max_live_parameters",
                 "stage3_param_persistence_threshold": "param_persistence_threshold",
                 "param_persistence_threshold": "param_persistence_threshold"}
_STAGE3_NO_EFFECT = {"stage3_max_reuse_distance", "max_reuse_distance", "allgather_bucket_size", "leaf_module"}
_STAGE3_GATHER_ON_SAVE = {"stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                          "gather_16bit_weights_on_model_save"}
_NO_GLOBAL_BOUND = "shardopt has no bound on all persistent parameters together; use stage3_param_persistence_threshold"
_BY_BUCKET = "shardopt gathers by bucket, never by module group; set reduce_bucket_size to change the gather unit"
_STAGE3_ONLY_VALUE = {
    "stage3_model_persistence_threshold": (sys.maxsize, _NO_GLOBAL_BOUND),
    "model_persistence_threshold": (sys.maxsize, _NO_GLOBAL_BOUND),
    "stage3_module_granularity_threshold": (0, _BY_BUCKET),
    "module_granularity_threshold": (0, _BY_BUCKET),
    "stage3_use_all_reduce_for_fetch_params": (False, "parameters are always fetched with an all-gather"),
    "use_all_reduce_for_fetch_params": (False, "parameters are always fetched with an all-gather"),
}
_STAGE3_ONLY = (set(_STAGE3_SIZES) | (_STAGE3_NO_EFFECT - {"allgather_bucket_size"}) | _STAGE3_GATHER_ON_SAVE
                | set(_STAGE3_ONLY_VALUE) | {"stage3_allgather_sequential", "allgather_sequential", "offload_param",
                                            "cpu_offload_param"})
"""What DeepSpeed reads at stage 3 only (and ignores below it)."""
_ZERO_ONLY_VALUE = {"reduce_scatter": True, "allgather_partitions": True, "zero_hpz_partition_size": 1,
                    "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
                    "zero_quantized_gradients": False, "compute_grad_norm": True, "parameter_alignment": False,
                    "legacy_stage1": False, "zenflow": None}
_ZERO_PLUS_PLUS = {  # ZeRO++ (stage 3 in DeepSpeed): what shardopt offers at stages 1-2 instead
    "zero_hpz_partition_size": "; to shard inside a node and replicate across nodes, pass "
                               "shard_group='node' (or mesh=...) to from_config",
    "zero_quantized_gradients": "; to quantize the gradients that cross between nodes, pass "
                                "shard_group='node', inter_node_dtype='int8' to from_config",
}
_HINTS = {
    "scheduler": "only \"WarmupLR\" is translated; for others use a torch.optim.lr_scheduler on the "
                 "ShardedOptimizer (its param_groups work as torch's)",
    "activation_checkpointing": "use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) in the model",
    "amp": "use \"bf16\" or \"fp16\"",
    "gradient_predivide_factor": "shardopt always divides by the world size before reducing; remove the key",
}
_ELEMENTWISE_TORCH = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta")
_TRANSLATED = ("zero_optimization", "optimizer", "fp16", "bf16", "bfloat16", "communication_data_type",
               "gradient_clipping", "scheduler", "aio")
_TOP_KEYS = frozenset(_TRANSLATED) | _TOP_NO_EFFECT | set(_LOOP_KEYS) | set(_HINTS)
_WARMUP_LR_KEYS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DS_GRADIENT_CLIPPING_DEFAULT = 1.0


@dataclasses.dataclass(frozen=True)
class Translation:
    """What a DeepSpeed config means for a ShardedOptimizer."""

    optim: type | None
    """The inner torch optimizer class; None when the config has no "optimizer" block."""
    optim_kwargs: dict
    """Its hyper-parameters (lr, betas, ...)."""
    kwargs: dict
    """ShardedOptimizer keyword arguments, only those that differ from its defaults (so a plain fp32
    config builds on any version of the API). `loss_scale`, when fp16 is dynamic, is the dict of
    shardopt.LossScaleConfig fields (this module stays importable without it)."""
    param_dtype: torch.dtype | None
    """torch.bfloat16 / torch.float16 when the config enables bf16 / fp16: the model's parameters must
    already have that dtype. None: fp32."""
    ignored: tuple[str, ...]
    """Keys accepted without effect on the optimizer (training-loop keys and no-op keys)."""
    gradient_accumulation_steps: int = 1
    """The config's accumulation, which the training loop must now do itself."""
    gather_weights_on_save: bool | None = None
    """Stage 3: the config's stage3_gather_16bit_weights_on_model_save (None: absent), for trainers that save
    models (Note [DeepSpeed's stage-3 keys])."""
    scheduler: tuple | None = None
    """(scheduler class, its kwargs) for a "scheduler" block (WarmupLR); from_config builds it as
    `optimizer.lr_scheduler`."""
    not_applicable: tuple[str, ...] = ()
    """Keys accepted but meaningless here (1-bit Adam's MPI/NCCL backend choice): reported once."""


def load_config(config) -> dict:
    """A DeepSpeed config given as a dict (copied) or a path to a JSON file."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                out = json.load(f)
        except OSError as e:
            raise FileNotFoundError(f"cannot read DeepSpeed config '{config}': {e.strerror}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config '{config}' is not valid JSON: {e}") from e
        if not isinstance(out, dict):
            raise ValueError(f"DeepSpeed config '{config}' must hold a JSON object, got {type(out).__name__}")
        return out
    raise TypeError(f"config must be a dict or the path of a DeepSpeed JSON file, got {type(config).__name__}")


def _auto_paths(node, path="") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _auto_paths(v, f"{path}[{i}]")]
    return [path] if _is_auto(node) else []


def _is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


class _Reader:
    """Collects translated values and every problem, so one error can list them all."""

    def __init__(self):
        self.problems: list[str] = []
        self.ignored: list[str] = []
        self.not_applicable: list[str] = []
        self.unknown: list[str] = []

    def refuse(self, path: str, value: Any, why: str, even_auto: bool = False) -> None:
        if _is_auto(value) and not even_auto:
            return  # reported once, with every other "auto", by translate()
        shown = json.dumps(value, default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        self.problems.append(f"  {path} = {shown}: {why}")

    def whole(self, path: str, value, minimum: int = 1):
        """A whole number (JSON floats such as 2e8 included), or None after recording a problem."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
                or value < minimum:
            self.refuse(path, value, f"must be a whole number >= {minimum}")
            return None
        return int(value)

    def known(self, path: str, key: str, value, names, removed: dict | None = None) -> bool:
        """Whether `key` is one of DeepSpeed's `names`; if not, refused by name (with the nearest one)."""
        if key in names:
            return True
        why = (removed or {}).get(key)
        if why is None:
            near = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.8)
            why = "unknown key, which DeepSpeed refuses too" + (f": did you mean {near[0]!r}?" if near else "")
        self.unknown.append(path)
        self.refuse(path, value, why, even_auto=True)
        return False

    def flag(self, path: str, value):
        if not isinstance(value, bool):
            self.refuse(path, value, "must be true or false")
            return None
        return value


def _zero(r: _Reader, z: dict, out: dict) -> str:
    """zero_optimization -> stage, buckets, overlap, offload. Returns the offload device."""
    if not isinstance(z, dict):
        r.refuse("zero_optimization", z, "must be an object")
        return "none"
    stage = z.get("stage", 0)
    if stage in (1, 2, 3) and not isinstance(stage, bool):
        out["stage"] = stage
    elif stage == 0:
        r.refuse("zero_optimization.stage", stage, "stage 0 is plain data parallelism: use torch's "
                 "DistributedDataParallel, or set stage 1, 2 or 3")
    else:
        r.refuse("zero_optimization.stage", stage, "must be 1, 2 or 3")
    offload = Offload()  # Note [DeepSpeed's offload keys] in deepspeed_offload.py
    for key, value in z.items():
        path = f"zero_optimization.{key}"
        if key == "stage" or not r.known(path, key, value, DS_ZERO_KEYS, _REMOVED_ZERO_KEYS):
            continue
        if key in ("offload_param", "cpu_offload_param"):  # read at stage 3 only, as DeepSpeed does
            block = offload.param if stage == 3 else {"device": "none"}
            if key == "offload_param":
                read_block(r, path, value, block, DS_OFFLOAD_PARAM_KEYS)
            elif value is not None and r.flag(path, value):
                block["device"] = "cpu"
            if stage != 3:
                r.ignored.append(path)
            continue
        if stage == 3 and _stage3_key(r, path, key, value, out):
            continue
        if key in ("reduce_bucket_size", "allgather_bucket_size"):
            n = r.whole(path, value)
            if n is not None:
                out[key] = n
        elif key == "overlap_comm":
            if r.flag(path, value) is not None:
                out[key] = value
        elif key == "offload_optimizer":
            read_block(r, path, value, offload.optimizer, DS_OFFLOAD_OPTIMIZER_KEYS)
        elif key == "cpu_offload":  # DeepSpeed's older spelling of offload_optimizer.device = "cpu"
            if value is not None and r.flag(path, value):
                offload.optimizer["device"] = "cpu"
        elif key == "cpu_offload_use_pin_memory":
            if value is not None and r.flag(path, value) is not None:
                offload.optimizer["pin_memory"] = value
        elif key in _STAGE3_ONLY:  # below stage 3 (at 3, _stage3_key read it)
            r.ignored.append(path)
        elif key in _ZERO_NO_EFFECT:
            r.ignored.append(path)
        elif key in _ZERO_ONLY_VALUE:
            if value != _ZERO_ONLY_VALUE[key] or type(value) is not type(_ZERO_ONLY_VALUE[key]):
                r.refuse(path, value, f"not supported; only {json.dumps(_ZERO_ONLY_VALUE[key])} "
                         "(what shardopt always does)" + _ZERO_PLUS_PLUS.get(key, ""))
        else:
            r.refuse(path, value, "not supported by shardopt; remove it")
    return finish(r, offload, out)


def _stage3_key(r: _Reader, path: str, key: str, value, out: dict) -> bool:
    """A zero_optimization key read the stage-3 way (Note [DeepSpeed's stage-3 keys]); False: not one of them."""
    if key in _STAGE3_SIZES:
        n = r.whole(path, value, minimum=0)
        if n is not None:
            out[_STAGE3_SIZES[key]] = n
    elif key in _STAGE3_NO_EFFECT:
        if key != "allgather_bucket_size" or _is_auto(value) or r.whole(path, value) is not None:
            r.ignored.append(path)
    elif key in _STAGE3_GATHER_ON_SAVE:
        if r.flag(path, value) is not None:
            out["gather_weights_on_save"] = value
    elif key in ("stage3_allgather_sequential", "allgather_sequential"):
        if r.flag(path, value):
            out["prefetch_bucket_size"] = 0
    elif key in _STAGE3_ONLY_VALUE:
        want, why = _STAGE3_ONLY_VALUE[key]
        if value != want or isinstance(value, bool) != isinstance(want, bool):
            r.refuse(path, value, f"only {json.dumps(want)}: {why}")
    else:
        return False
    return True


def _optimizer(r: _Reader, spec, offload: str):
    """optimizer -> (class, kwargs). See Note [DeepSpeed defaults that change results]."""
    from shardopt.cpu_adam import CPUAdam

    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        r.refuse("optimizer", spec, "must be an object with a \"type\" string and \"params\"")
        return None, {}
    for key, v in spec.items():
        if key not in ("type", "params") and not (key == "legacy_fusion" and v is False):
            r.refuse(f"optimizer.{key}", v, "not supported by shardopt; remove it")
    name = spec["type"]
    params = spec.get("params", {}) or {}
    if not isinstance(params, dict):
        r.refuse("optimizer.params", params, "must be an object")
        return None, {}
    params = dict(params)
    if "max_grad_norm" in params:
        r.refuse("optimizer.params.max_grad_norm", params.pop("max_grad_norm"),
                 "DeepSpeed refuses it too: use the top-level \"gradient_clipping\"")
    if params.get("betas") is not None:
        params["betas"] = tuple(params["betas"])
    if name.lower() in ("adam", "adamw"):
        adam_w_mode = params.pop("adam_w_mode", True)
        adamw = name.lower() == "adamw" or bool(adam_w_mode)  # DeepSpeed: "Adam" means AdamW by default
        torch_adam = bool(params.pop("torch_adam", False))
        if params.pop("fp32_optimizer_states", True) is not True:
            r.refuse("optimizer.params.fp32_optimizer_states", False, "optimizer state is always fp32")
        if torch_adam:  # DeepSpeed builds torch's class, with torch's defaults
            return (torch.optim.AdamW if adamw else torch.optim.Adam), params
        params.setdefault("weight_decay", 0.0)
        if offload in ("cpu", "nvme"):
            return CPUAdam, {**params, "adamw": adamw}
        if params.pop("bias_correction", True) is not True:
            r.refuse("optimizer.params.bias_correction", False,
                     "torch's Adam always corrects bias; only supported with offload_optimizer.device = \"cpu\"")
        return (torch.optim.AdamW if adamw else torch.optim.Adam), params
    if name.lower() == "onebitadam":  # "OneBitAdam" / "OnebitAdam": Note [1-bit Adam under ZeRO] in onebit.py
        from shardopt.onebit import OneBitAdam
        for key in ("cuda_aware", "comm_backend_name"):
            if key in params:  # DeepSpeed's MPI/NCCL backend choice: we use the process group's backend
                params.pop(key)
                r.ignored.append(f"optimizer.params.{key}")
                r.not_applicable.append(f"optimizer.params.{key}")
        if params.pop("amsgrad", False) is not False:
            r.refuse("optimizer.params.amsgrad", True, "1-bit Adam has no AMSGrad variant (DeepSpeed refuses it too)")
        if params.pop("bias_correction", True) is not True:
            r.refuse("optimizer.params.bias_correction", False, "shardopt's warm-up is its AdamW path, which always "
                     "corrects bias; remove the key")
        allowed = {"lr", "betas", "eps", "weight_decay", "freeze_step"}
        for key in sorted(set(params) - allowed):
            r.refuse(f"optimizer.params.{key}", params.pop(key), f"not a OneBitAdam parameter shardopt knows "
                     f"({', '.join(sorted(allowed | {'cuda_aware', 'comm_backend_name'}))})")
        if "freeze_step" in params:
            params["freeze_step"] = r.whole("optimizer.params.freeze_step", params["freeze_step"])
        return OneBitAdam, params
    if name.lower() in ("zerooneadam", "onebitlamb"):
        r.refuse("optimizer.type", name, "not built in shardopt (0/1 Adam's local steps and 1-bit LAMB's "
                 "scaling coefficients are other algorithms); use \"OneBitAdam\" or \"AdamW\"")
        return None, {}
    if name.lower() == "adagrad":
        return torch.optim.Adagrad, params
    if name in _ELEMENTWISE_TORCH:  # DeepSpeed: getattr(torch.optim, type) for types it does not know
        return getattr(torch.optim, name), params
    r.refuse("optimizer.type", name, "shardopt runs Adam, AdamW, Adagrad or an elementwise torch.optim "
             f"class ({', '.join(_ELEMENTWISE_TORCH)}); for others drop the \"optimizer\" block and pass "
             "optim=<class> and its keyword arguments to from_config")
    return None, {}


def _precision(r: _Reader, config: dict, out: dict):
    """fp16 / bf16 / communication_data_type -> param dtype, loss scaling, reduce dtype."""
    fp16 = config.get("fp16") or {}
    bf16 = config.get("bf16", config.get("bfloat16")) or {}
    for name, block in (("fp16", fp16), ("bf16", bf16)):
        if not isinstance(block, dict):
            r.refuse(name, block, "must be an object like {\"enabled\": true}")
    fp16 = fp16 if isinstance(fp16, dict) else {}
    bf16 = bf16 if isinstance(bf16, dict) else {}
    for name in ("fp16", "bf16", "bfloat16"):
        block = config.get(name)
        if isinstance(block, dict):  # DeepSpeed checks the names of a disabled block too, and no value
            for key, v in block.items():
                r.known(f"{name}.{key}", key, v, DS_FP16_KEYS if name == "fp16" else DS_BF16_KEYS)
            if block.get("enabled", False) is False:
                r.ignored.append(name)
    dtype = None
    if fp16.get("enabled") is True and bf16.get("enabled") is True:
        r.refuse("fp16.enabled / bf16.enabled", True, "enable at most one of them")
    elif fp16.get("enabled") is True:
        dtype = torch.float16
        out["loss_scale"] = _loss_scale(r, fp16)
    elif bf16.get("enabled") is True:
        dtype = torch.bfloat16
        bf_name = "bf16" if "bf16" in config else "bfloat16"
        ok = {"enabled": True, "immediate_grad_update": False, "check_grad_overflow": True,
              "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
        for key, v in bf16.items():
            if key in ok and v != ok[key]:
                why = {"check_grad_overflow": "shardopt always checks for inf/nan (nonfinite=\"skip\" or "
                       "\"raise\"); remove the key"}.get(key, "master weights and optimizer state are always "
                                                          "fp32 and gradients are applied at step()")
                r.refuse(f"{bf_name}.{key}", v, why)
    comm = config.get("communication_data_type")
    if comm is not None:
        if not isinstance(comm, str) or comm.lower() not in _COMM_DTYPES:
            r.refuse("communication_data_type", comm, "must be \"fp32\", \"fp16\" or \"bf16\"")
        elif _COMM_DTYPES[comm.lower()] is not torch.float32:  # fp32 is the default
            out["reduce_dtype"] = _COMM_DTYPES[comm.lower()]
    elif dtype is not None:  # DeepSpeed reduces in the model's dtype unless told otherwise
        out["reduce_dtype"] = dtype
    return dtype


def _loss_scale(r: _Reader, fp16: dict):
    for key, v in fp16.items():
        if key in ("auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"):
            if v is not False:
                why = {"auto_cast": "cast inputs yourself (or use torch.autocast)"}.get(
                    key, "not supported by shardopt")
                r.refuse(f"fp16.{key}", v, why + "; only false")
    scale = fp16.get("loss_scale", 0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
        r.refuse("fp16.loss_scale", scale, "must be 0 (dynamic) or a positive static scale")
        return None
    if scale > 0:
        return float(scale)
    power = r.whole("fp16.initial_scale_power", fp16.get("initial_scale_power", 16), minimum=0)
    window = r.whole("fp16.loss_scale_window", fp16.get("loss_scale_window", 1000))
    hysteresis = r.whole("fp16.hysteresis", fp16.get("hysteresis", 2))
    min_scale = fp16.get("min_loss_scale", 1)
    if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)) or min_scale <= 0:
        r.refuse("fp16.min_loss_scale", min_scale, "must be > 0")
        return None
    if None in (power, window, hysteresis):
        return None
    # DeepSpeed's DynamicLossScaler doubles / halves (scale_factor 2).
    return dict(init_scale=2.0 ** power, growth_factor=2.0, backoff_factor=0.5, growth_interval=window,
                hysteresis=hysteresis, min_scale=float(min_scale), dynamic=True)


def _clipping(r: _Reader, config: dict, out: dict) -> None:
    clip = config.get("gradient_clipping", _DS_GRADIENT_CLIPPING_DEFAULT)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        r.refuse("gradient_clipping", clip, "must be a number >= 0 (0: no clipping)")
    elif clip > 0:
        out["max_grad_norm"] = float(clip)


def translate(config) -> Translation:
    """Translates a DeepSpeed config (dict or JSON path); raises one ValueError listing every problem."""
    config = load_config(config)
    r = _Reader()
    out: dict = {}
    offload = "none"
    if "zero_optimization" in config:
        offload = _zero(r, config["zero_optimization"], out)
    else:
        r.refuse("zero_optimization", None, "missing: add {\"stage\": 2} (or 1 or 3)")
    optim, optim_kwargs = None, {}
    if "optimizer" in config:
        optim, optim_kwargs = _optimizer(r, config["optimizer"], offload)
    dtype = _precision(r, config, out)
    _clipping(r, config, out)
    scheduler = _scheduler(r, config["scheduler"]) if "scheduler" in config else None
    if "aio" in config:
        read_aio(r, config["aio"], out)
    gas = 1
    for key, value in config.items():
        if key in _TRANSLATED:
            continue
        if key in _LOOP_KEYS:
            r.ignored.append(key)
            if key == "gradient_accumulation_steps" and isinstance(value, int) and not isinstance(value, bool):
                gas = value
        elif key in _TOP_NO_EFFECT or (key == "gradient_predivide_factor" and value == 1.0):
            r.ignored.append(key)
        elif key in _HINTS:
            r.refuse(key, value, _HINTS[key])
        else:
            near = difflib.get_close_matches(key, sorted(_TOP_KEYS), n=1, cutoff=0.8)
            r.refuse(key, value, f"did you mean {near[0]!r}?" if near else "not supported by shardopt; remove it",
                     even_auto=True)
    # "auto" only where the value matters: not in ignored or refused blocks.
    autos = [a for a in _auto_paths({k: v for k, v in config.items() if k in _TRANSLATED})
             if not any(a == i or a.startswith(i + ".") for i in r.ignored + r.unknown)]
    if autos:
        r.problems.insert(0, f"  {', '.join(autos)} = \"auto\": only the Hugging Face Trainer / Accelerate "
                          "integration fills in \"auto\"; write the values (or pass the config the Trainer has "
                          "filled in)")
    if r.problems:
        raise ValueError("this DeepSpeed config cannot be used as is:\n" + "\n".join(r.problems)
                         + "\n(see Note [DeepSpeed keys: translated, accepted, refused] in shardopt/deepspeed_config.py)")
    gather_on_save = out.pop("gather_weights_on_save", None)
    return Translation(optim=optim, optim_kwargs=optim_kwargs, kwargs=out, param_dtype=dtype,
                       ignored=tuple(r.ignored), gradient_accumulation_steps=gas,
                       gather_weights_on_save=gather_on_save, scheduler=scheduler,
                       not_applicable=tuple(r.not_applicable))


def _scheduler(r: _Reader, spec):
    """scheduler -> (class, kwargs): DeepSpeed's WarmupLR (shardopt.lr_schedules), refused otherwise."""
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        r.refuse("scheduler", spec, "must be an object with a \"type\" string and \"params\"")
        return None
    if spec["type"] != "WarmupLR":
        r.refuse("scheduler.type", spec["type"], _HINTS["scheduler"])
        return None
    params = dict(spec.get("params") or {})
    for key in sorted(set(params) - set(_WARMUP_LR_KEYS)):
        r.refuse(f"scheduler.params.{key}", params.pop(key), f"not a WarmupLR parameter ({', '.join(_WARMUP_LR_KEYS)})")
    from shardopt.lr_schedules import WarmupLR
    return WarmupLR, params


def _first_param(params: list):
    for item in params:
        for p in (item["params"] if isinstance(item, dict) else [item]):
            if isinstance(p, torch.Tensor) and p.requires_grad:
                return p
    return None


def optimizer_arguments(params, config, overrides: dict) -> tuple[list, dict]:
    """(params as a list, ShardedOptimizer keyword arguments) for `from_config`.

    `overrides` (from_config's keyword arguments) win over the config, e.g.
    `process_group=...`, or `optim=...` with its kwargs when the config has no
    "optimizer" block.
    """
    t = translate(config)
    params = list(params)
    p = _first_param(params)
    want = t.param_dtype or torch.float32
    if p is not None and p.dtype != want:
        if t.param_dtype is not None:
            raise TypeError(
                f"the config enables {'bf16' if want is torch.bfloat16 else 'fp16'} but the parameters are "
                f"{p.dtype}. DeepSpeed casts the model itself; shardopt does not own the model: call "
                f"model.to({want}) before building the optimizer (it keeps fp32 master weights).")
        raise TypeError(f"the parameters are {p.dtype} but the config enables neither \"bf16\" nor \"fp16\": add "
                        f"{{\"{'bf16' if p.dtype is torch.bfloat16 else 'fp16'}\": {{\"enabled\": true}}}} to it, "
                        "or train an fp32 model")
    if t.gradient_accumulation_steps > 1:
        warnings.warn(f"the config's gradient_accumulation_steps={t.gradient_accumulation_steps} is ignored: "
                      "shardopt does not drive the loop. Accumulate yourself: run all but the last micro-batch "
                      "under `with model.no_sync():`, divide each loss by the number of micro-batches, and "
                      "call step() once per accumulation.", stacklevel=3)
    if t.not_applicable:
        warnings.warn(f"{', '.join(t.not_applicable)}: not applicable in shardopt (it communicates over the "
                      "process group it is given, with that group's backend); accepted and ignored", stacklevel=3)
    if t.ignored:
        logger.warning("DeepSpeed config: accepted without effect in shardopt: %s (why: docs/checkpoints-and-"
                       "migration.md, Coming from DeepSpeed)", ", ".join(t.ignored))
    kwargs = dict(t.kwargs)
    if "loss_scale" in kwargs and isinstance(kwargs["loss_scale"], dict):
        kwargs["loss_scale"] = _loss_scale_config(kwargs["loss_scale"])
    if t.optim is not None:
        kwargs["optim"] = t.optim
        kwargs.update(t.optim_kwargs)
    elif "optim" not in overrides:
        raise ValueError("the config has no \"optimizer\" block: add one (e.g. {\"type\": \"AdamW\", \"params\": "
                         "{\"lr\": 3e-4}}), or pass optim=<torch optimizer class> and its keyword arguments to "
                         "from_config")
    kwargs.update(overrides)
    return params, kwargs


def _loss_scale_config(fields: dict):
    import shardopt

    cls = getattr(shardopt, "LossScaleConfig", None)
    if cls is None:
        raise NotImplementedError("this config enables fp16 loss scaling, which needs shardopt.LossScaleConfig "
                                  "(mixed precision, issue 5); this build does not have it yet")
    return cls(**fields)
