"""DeepSpeed ZeRO-1/2 checkpoint folders, read as shardopt checkpoint chunks (no DeepSpeed needed).

    shardopt.load_checkpoint("ds_ckpt", model, opt)       # the folder given to engine.save_checkpoint
    python -m shardopt convert ds_ckpt out.pt             # one plain torch file

`DeepSpeedSource` answers the loader's questions (checkpoint.Source) from DeepSpeed's files: loading at any
world size, stage and bucket size is the native loader's work. Pure file code. ZeRO-3: deepspeed_zero3.py.

Note [DeepSpeed ZeRO-1/2 checkpoint files]
------------------------------------------
What `engine.save_checkpoint(dir)` writes in DeepSpeed 0.19 (stage_1_and_2.py, engine.py):

    dir/latest                                text: the tag (e.g. global_step4)
    dir/<tag>/mp_rank_00_model_states.pt      {"module": the state_dict, "param_shapes": per group {name: shape},
                                              "shared_params", "buffer_names", "ds_config", client_state keys}
    dir/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   {"optimizer_state_dict": {"single_partition_
        of_fp32_groups": per group rank r's fp32 masters, "base_optimizer_state": the inner optimizer's over
        them, "param_slice_mappings": per group {name: fragment_address(numel, start)}, "zero_stage", ...}}

Per param group the parameters lie in one padded flat buffer cut into world-size partitions; rank r's masters
and Adam moments are partition r. A parameter is one contiguous run, so its fragments on ranks 0, 1, ... are
consecutive ranges of it: `param_slice_mappings[g][name]` on rank r gives the fragment's start and numel in
the partition, and its offset in the parameter is the sum of the numels on earlier ranks. So each fragment
is a chunk (name, [lo, hi)) with no assumption on ordering or padding, and every parameter must be tiled
exactly once (checked against `param_shapes`). A group's one step count becomes every chunk's `step`.
Refused, naming the fix: other parallelisms (pipeline, tensor, experts), an optimizer other than Adam / AdamW
or a decay or bias correction unlike ours, DeepSpeed < 0.8. DeepSpeed's LR scheduler state is returned in
`extra`; fp16 loss scaling maps (scale and hysteresis).

Note [Reading DeepSpeed files without unpickling code]
------------------------------------------------------
DeepSpeed's torch.save files hold a few DeepSpeed objects besides tensors (`fragment_address`,
`ZeroStageEnum`, loss scalers). We load with weights_only=True and allow exactly those names, mapped to
inert stand-ins defined here; weights_only=False (trusted files only) unpickles anything else a
client_state holds, still with the stand-ins. Files are memory-mapped: a rank touches only the pages it needs.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import re
import types

import torch

from shardopt.checkpoint.source import PARAM, SAME_STATE, Source, class_name
from shardopt.files import CheckpointError
from shardopt.checkpoint.pieces import Chunk, resolve_hyper

MODEL_FILE = "mp_rank_00_model_states.pt"
_OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# Model-states keys DeepSpeed itself writes; any other top-level key is the user's client_state.
_DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
            "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
            "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
            "checkpoint_parallel_dimensions", "universal_checkpoint_info", "sparse_tensor_module_names"}
_ADAM_STATE = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
# Hyper-parameters that mean the same in DeepSpeed's Adam variants and ours; the rest stay as built.
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def looks_like_deepspeed(directory: str) -> bool:
    """Whether `directory` is a DeepSpeed checkpoint tag folder (ZeRO-1/2 or one we refuse with a reason)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(n.endswith("_model_states.pt") or n.endswith("_optim_states.pt") for n in names)


class _Record:
    """Stand-in for a pickled DeepSpeed object: its attributes, nothing else."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class fragment_address(_Record):  # noqa: N801 - the pickled name
    pass


class LossScaler(_Record):
    pass


def _zero_stage(value):
    return int(value)


_STANDINS = {
    "deepspeed.utils.tensor_fragment.fragment_address": fragment_address,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScaler,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return _STANDINS.get(f"{module}.{name}") or super().find_class(module, name)


_TRUSTED_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(),
                                        __name__="shardopt.checkpoint.deepspeed_reader.pickle")


def load_file(path: str, weights_only: bool = True):
    """One DeepSpeed file (Note [Reading DeepSpeed files without unpickling code])."""
    try:
        if weights_only:
            with torch.serialization.safe_globals([(v, k) for k, v in _STANDINS.items()]):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True, pickle_module=_TRUSTED_PICKLE)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the DeepSpeed checkpoint is incomplete") from None
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path} holds objects other than tensors and DeepSpeed's own bookkeeping{what}, e.g. in "
            "client_state; if you trust the file, pass weights_only=False (or `convert --trust-extra`)") from None
    except RuntimeError as e:
        raise CheckpointError(f"{path} cannot be read ({e}): the file is damaged or not a torch file") from None


def is_zero3(names) -> bool:
    """Whether a tag folder's file names are a ZeRO-3 checkpoint's (model states per rank, none shared)."""
    return MODEL_FILE not in names and any(_ZERO3_MODEL_FILE.match(n) for n in names)


def refuse_parallel_layouts(directory: str, names) -> None:
    """Refuses pipeline-parallel and mixture-of-experts folders, which no reader here maps."""
    if any(n.startswith("layer_") for n in names):
        raise CheckpointError(f"{directory} is a DeepSpeed pipeline-parallel checkpoint (layer_* files): its model "
                              "is split into stages; only data-parallel ZeRO checkpoints map onto shardopt")
    if any("expp_rank" in n or n.startswith("expert_") for n in names):
        raise CheckpointError(f"{directory} holds mixture-of-experts state (expert-parallel files): experts are "
                              "partitioned over other groups, which shardopt does not describe")


def optimizer_files(directory: str, names) -> list:
    """The [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt names, by rank; refuses gaps."""
    files = {}
    for n in names:
        m = _OPTIM_FILE.match(n)
        if m:
            files[int(m.group(2))] = n
    if not files:
        raise CheckpointError(f"{directory} has no *_zero_pp_rank_*_optim_states.pt files: the optimizer "
                              "state was not saved (save_checkpoint with the ZeRO optimizer)")
    world = len(files)
    if sorted(files) != list(range(world)):
        raise CheckpointError(f"{directory}: optimizer files for ranks {sorted(files)}, expected 0..{world - 1} "
                              "(some are missing)")
    return [files[r] for r in range(world)]


def _steps_of(state: dict, group: dict, where: str):
    step = state.get("step", group.get("step"))  # an int (CPU Adam), a tensor, or in the group (FusedAdam)
    if step is None:
        raise CheckpointError(f"{where}: no step count in the optimizer state or its param group")
    return float(step)


def _tuples(v):
    return tuple(v) if isinstance(v, list) else v


def check_partition_count(directory: str, sd: dict, world_size: int, why: str) -> None:
    """Refuses a rank's optimizer file partitioned over other ranks than the folder's."""
    counts = sd.get("partition_count")
    counts = counts if isinstance(counts, (list, tuple)) else [counts]
    if any(c is not None and int(c) != world_size for c in counts):
        raise CheckpointError(f"{directory}: partition_count {list(counts)} but {world_size} rank files ({why})")


class DeepSpeedSource(Source):
    """A DeepSpeed ZeRO-1/2 tag folder as checkpoint.Source (Note [DeepSpeed ZeRO-1/2 checkpoint files])."""

    def __init__(self, directory: str, weights_only: bool = True):
        self.directory = directory
        names = sorted(os.listdir(directory))
        self._refuse_layouts(names)
        self.meta = load_file(os.path.join(directory, MODEL_FILE), weights_only)
        self._check_meta(self.meta)
        files = optimizer_files(directory, names)
        self._ranks = [load_file(os.path.join(directory, f), weights_only) for f in files]
        self.world_size = len(files)
        sds = [f["optimizer_state_dict"] for f in self._ranks]
        self._check_zero(sds[0])
        self._flat = [sd["single_partition_of_fp32_groups"] for sd in sds]
        base = sds[0]["base_optimizer_state"]
        n_groups = len(base["param_groups"]) if isinstance(base, dict) else len(base)
        if n_groups != len(self.meta["param_shapes"]):
            raise CheckpointError(f"{self.directory}: {n_groups} optimizer param groups but "
                                  f"{len(self.meta['param_shapes'])} groups of parameter shapes")
        self._slot_group = list(range(n_groups))   # one flat partition per param group
        self._check_adam([s["base_optimizer_state"] for s in sds], [s.get("base_optimizer_state_step") for s in sds])
        self._build_fragments(sds)
        self.scaler = self._scaler(sds[0])

    def _refuse_layouts(self, names):
        d = self.directory
        refuse_parallel_layouts(d, names)
        if is_zero3(names):
            raise CheckpointError(f"{d} is a DeepSpeed ZeRO stage 3 checkpoint (parameters partitioned too): "
                                  "open it with shardopt.checkpoint.deepspeed_zero3.DeepSpeedZero3Source "
                                  "(load_checkpoint and convert do)")
        if MODEL_FILE not in names:
            other = [n for n in names if n.endswith("_model_states.pt")]
            raise CheckpointError(f"{d} has no {MODEL_FILE} ({', '.join(other) or 'no model states'}): written "
                                  "with tensor/model parallelism, which is not mapped onto shardopt")

    def _check_meta(self, meta: dict):
        directory = self.directory
        dims = meta.get("checkpoint_parallel_dimensions") or {}
        if (meta.get("mp_world_size") or 1) > 1 or (dims.get("tp_degree") or 1) > 1:
            raise CheckpointError(f"{directory} was written with tensor/model parallelism (degree "
                                  f"{max(meta.get('mp_world_size') or 1, dims.get('tp_degree') or 1)}): its weights "
                                  "are split inside parameters; only pure data-parallel ZeRO checkpoints map "
                                  "onto shardopt")
        if (dims.get("pp_degree") or 1) > 1:
            raise CheckpointError(f"{directory} was written with pipeline parallelism: not mapped onto shardopt")
        if not meta.get("param_shapes"):
            raise CheckpointError(f"{directory} has no ZeRO optimizer state (DeepSpeed ran without "
                                  "zero_optimization, or saved weights only); load its 'module' weights with "
                                  "model.load_state_dict(torch.load(...)['module'])")

    def _check_zero(self, sd: dict):
        stage = sd.get("zero_stage")
        if stage is not None and int(stage) not in (1, 2):
            raise CheckpointError(f"{self.directory} is a ZeRO stage {int(stage)} checkpoint; shardopt reads "
                                  "stages 1 and 2")
        if "param_slice_mappings" not in sd:
            raise CheckpointError(f"{self.directory} has no param_slice_mappings (written by a DeepSpeed older "
                                  "than 0.8): load it in a newer DeepSpeed, save again, then load that")
        check_partition_count(self.directory, sd, self.world_size,
                              "expert or sequence-parallel groups are not mapped onto shardopt")

    def _check_adam(self, bases: list, elastic_steps: list):
        """Sets self.decoupled and self._groups from `bases`, per rank a state_dict (or an elastic list)."""
        cfg = self.meta.get("ds_config") or {}
        if isinstance(cfg, str):  # deepspeed.initialize(config="ds.json") saves the path
            try:
                with open(cfg) as f:
                    cfg = json.load(f)
            except (OSError, ValueError):
                cfg = {}
        cfg = cfg if isinstance(cfg, dict) else {}
        opt_cfg = cfg.get("optimizer") or {}
        kind = str(opt_cfg.get("type", "")).lower()
        if kind and kind not in ("adam", "adamw", "cpuadam", "fusedadam"):
            raise CheckpointError(f"{self.directory} was trained with DeepSpeed's {opt_cfg.get('type')!r} optimizer; "
                                  "only Adam / AdamW state (exp_avg, exp_avg_sq, step) maps onto shardopt's")
        base = bases[0]
        self._groups = base["param_groups"] if isinstance(base, dict) else None
        self._base = bases
        self._elastic_steps = elastic_steps
        keys = set()
        for r in range(self.world_size):
            for slot in range(len(self._slot_group)):
                keys |= {k for k, v in self._state(r, slot).items() if torch.is_tensor(v) and v.dim() > 0}
        if not keys:
            raise CheckpointError(f"{self.directory} has no optimizer state (saved before the first step?)")
        if keys - _ADAM_STATE or not {"exp_avg", "exp_avg_sq"} <= keys:
            raise CheckpointError(f"{self.directory} holds optimizer state {sorted(keys)}: not Adam / AdamW "
                                  "(exp_avg, exp_avg_sq); only those map onto shardopt's optimizers")
        group = self._groups[0] if self._groups else {}
        if "decoupled_weight_decay" in group:          # torch.optim.Adam / AdamW
            self.decoupled = bool(group["decoupled_weight_decay"])
        elif kind:                                      # DeepSpeed's FusedAdam / CPU Adam from the config
            params = opt_cfg.get("params") or {}
            self.decoupled = kind == "adamw" or bool(params.get("adam_w_mode", True))
        else:
            raise CheckpointError(f"{self.directory}: cannot tell whether the optimizer was Adam (L2 decay) or "
                                  "AdamW (decoupled decay): neither its param groups nor ds_config say")
        if self._groups and any(g.get("bias_correction", True) is False for g in self._groups):
            raise CheckpointError(f"{self.directory} was trained with bias_correction=false, which torch's and "
                                  "shardopt's Adam always apply")

    def _state(self, rank: int, slot: int) -> dict:
        base = self._base[rank]
        if isinstance(base, dict):
            # torch numbers the flat partitions 0..S-1; an unstepped one has no entry
            return base["state"].get(slot, base["state"].get(str(slot), {}))
        return base[slot]

    def _build_fragments(self, sds: list):
        shapes = self.meta["param_shapes"]
        self.params = {}
        for g, group in enumerate(shapes):
            for name, shape in group.items():
                self.params[name] = {"shape": list(shape), "group": g}
        self._frags: dict = {}   # name -> [(lo, hi, rank, group, start in partition)]
        covered = dict.fromkeys(self.params, 0)
        for r, sd in enumerate(sds):
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                for name, addr in mapping.items():
                    if name not in self.params:
                        raise CheckpointError(f"{self.directory}: rank {r} maps {name!r}, which param_shapes lacks")
                    numel, start = int(addr.numel), int(addr.start)
                    lo = covered[name]
                    self._frags.setdefault(name, []).append((lo, lo + numel, r, g, start))
                    covered[name] = lo + numel
        self._check_tiled(covered)
        shared = self.meta.get("shared_params") or {}
        buffers = set(self.meta.get("buffer_names") or ())
        module = self.meta["module"]
        self.model_state = {}
        for k, v in module.items():
            if k in self.params or k in shared or not torch.is_tensor(v):
                continue
            self.model_state[k] = ("buffer" if k in buffers else "frozen", tuple(v.shape))

    def _check_tiled(self, covered: dict) -> None:
        """Every parameter's fragments, put together, are the whole parameter exactly once."""
        bad = [f"{n} ({c} of {math.prod(self.params[n]['shape'])} elements)" for n, c in covered.items()
               if c != math.prod(self.params[n]["shape"])]
        if bad:
            raise CheckpointError(f"{self.directory}: the rank files do not tile these parameters: "
                                  f"{', '.join(bad[:10])}; the checkpoint is incomplete or of another layout")

    def _scaler(self, sd: dict):
        ls = sd.get("loss_scaler")
        if not sd.get("dynamic_loss_scale") or ls is None or not hasattr(ls, "cur_scale"):
            return None
        hysteresis = getattr(ls, "cur_hysteresis", 1)
        clean = max(0, int(ls.cur_iter) - int(ls.last_overflow_iter) - 1) if hasattr(ls, "cur_iter") else 0
        return {"scale": float(ls.cur_scale), "clean_steps": clean % max(1, int(getattr(ls, "scale_window", 1))),
                "overflows_left": int(hysteresis)}

    def resolve_hyper(self, opt) -> list:
        cls = class_name(opt.optim_class)
        if cls not in SAME_STATE[0]:
            raise CheckpointError(f"{self.directory} holds Adam state; this optimizer is {cls}: build the "
                                  "ShardedOptimizer with torch.optim.AdamW / Adam (or shardopt.CPUAdam)")
        for i, g in enumerate(opt.param_groups):
            ours = g.get("adamw", g.get("decoupled_weight_decay", cls.endswith("AdamW")))
            if bool(ours) != self.decoupled:
                want = "AdamW (decoupled weight decay)" if self.decoupled else "Adam (L2 weight decay)"
                raise CheckpointError(f"{self.directory} was trained with {want}, param group {i} here is not: "
                                      f"build the ShardedOptimizer with "
                                      f"{'torch.optim.AdamW' if self.decoupled else 'torch.optim.Adam'} (or "
                                      f"CPUAdam(adamw={self.decoupled}))")
        if self._groups is None:   # elastic checkpoints keep no param groups: ours stay
            saved = [{} for _ in opt.param_groups]
        else:
            saved = [{k: _tuples(g[k]) for k in _HYPER if k in g} for g in self._groups]
        for i, (g, s) in enumerate(zip(opt.param_groups, saved)):
            if s.get("amsgrad") and "amsgrad" not in g:
                raise CheckpointError(f"{self.directory} used amsgrad, which {cls} does not have")
        return resolve_hyper(opt, saved, False, f"DeepSpeed checkpoint {self.directory}")

    def _step(self, rank: int, slot: int):
        if self._elastic_steps[rank] is not None:
            return float(self._elastic_steps[rank])
        saved_group = self._groups[self._slot_group[slot]] if self._groups else {}
        return _steps_of(self._state(rank, slot), saved_group, f"{self.directory} rank {rank} partition {slot}")

    def chunks(self, name: str, start: int, end: int) -> list:
        out = []
        for lo, hi, r, slot, at in self._frags.get(name, ()):
            if lo < end and hi > start:
                slices = {k: v.narrow(0, at, hi - lo).float()
                          for k, v in self._state(r, slot).items() if k in _ADAM_STATE}
                slices[PARAM] = self._flat[r][slot].narrow(0, at, hi - lo).float()
                out.append(Chunk(name, lo, hi, slices, {"step": torch.tensor(self._step(r, slot))}))
        return out

    def model_tensor(self, name: str) -> torch.Tensor:
        return self.meta["module"][name]

    def masters(self, name: str):
        for lo, hi, r, slot, at in self._frags.get(name, ()):  # views of the memory-mapped partitions
            yield lo, hi, self._flat[r][slot].narrow(0, at, hi - lo)

    def state_dict_names(self) -> list:
        shared = self.meta.get("shared_params") or {}
        out = []
        for k, v in self.meta["module"].items():
            name = shared.get(k, k)
            if name in self.params or name in self.model_state:
                out.append((k, name))
            elif torch.is_tensor(v):
                raise CheckpointError(f"{self.directory}: the saved module has {k!r}, which is neither a parameter "
                                      "nor a buffer of the checkpoint's records")
        return out

    def model_dtype(self, name: str) -> torch.dtype:
        return self.meta["module"][name].dtype  # at ZeRO-3 an empty tensor of the parameter's dtype

    def master_dtype(self) -> torch.dtype:
        return torch.float32  # DeepSpeed keeps fp32 masters whatever the model's dtype

    def extra(self):
        """What else DeepSpeed saved, for the caller: client_state keys, counters, its scheduler's state."""
        m = self.meta
        return {"client_state": {k: v for k, v in m.items() if k not in _DS_KEYS},
                "global_steps": m.get("global_steps"), "global_samples": m.get("global_samples"),
                "skipped_steps": m.get("skipped_steps"), "lr_scheduler": m.get("lr_scheduler"),
                "ds_version": m.get("ds_version")}

    def close(self) -> None:
        self._ranks = []


def to_torch(src: Source) -> dict:
    """A DeepSpeed source as convert.checkpoint_to_torch's {"model", "optimizer", "extra"} (torch.optim numbering
    in param_shapes order); closes `src`."""
    from shardopt.checkpoint.pieces import assemble

    try:
        shapes = {n: tuple(v["shape"]) for n, v in src.params.items()}
        full = assemble(shapes, (c for n, s in shapes.items() for c in src.chunks(n, 0, math.prod(s))))
        module = src.meta["module"]
        model = {}
        for k, v in module.items():
            if k in full:
                model[k] = full[k].pop(PARAM).to(v.dtype)
            elif k in src.model_state:
                model[k] = src.model_tensor(k)
            else:
                model[k] = v
        for alias, primary in (src.meta.get("shared_params") or {}).items():
            if primary in model:
                model[alias] = model[primary]   # one tensor: torch.save keeps the tie
        hyper = src._groups or [{} for _ in range(max(src._slot_group) + 1)]
        names = [[] for _ in hyper]
        for group in src.meta["param_shapes"]:
            for n in group:
                names[src.params[n]["group"]].append(n)
        groups, state, index = [], {}, 0
        for g, ns in enumerate(names):
            ids = []
            for n in ns:
                if full.get(n):
                    state[index] = full[n]
                ids.append(index)
                index += 1
            groups.append(dict({k: _tuples(hyper[g][k]) for k in _HYPER if k in hyper[g]}, params=ids))
        return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "extra": src.extra()}
    finally:
        src.close()
