"""DeepSpeed ZeRO-3 checkpoint folders, read as shardopt checkpoint chunks (no DeepSpeed needed).

    shardopt.load_checkpoint("ds_ckpt", model, opt)       # any stage, any world size
    python -m shardopt convert ds_ckpt out.pt             # one plain torch file

`open_deepspeed` picks the reader of a tag folder; stage 3's differs from ZeRO-1/2's (deepspeed_reader.py) only
in where a parameter's elements lie. Pure file code.

Note [DeepSpeed ZeRO-3 checkpoint files]
----------------------------------------
What `engine.save_checkpoint(dir)` writes at stage 3 in DeepSpeed 0.19 (engine.py, stage3.py):

    dir/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   per rank: {"module" (parameters empty, buffers
        whole), "param_shapes": per *sub-group* {name: shape}, "frozen_param_shapes", "frozen_param_fragments":
        {name: rank r's part}, "buffer_names", "shared_params", "ds_config", client_state keys}
    dir/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   {"optimizer_state_dict": {"zero_stage": 3,
        "fp32_flat_groups": per sub-group r's fp32 masters, "optimizer_state_dict": the inner optimizer's over
        them (in sub-group order, listed under their param groups), "loss_scaler", ...}}

Each parameter is partitioned on its own: n elements zero-padded to W parts of p = ceil(n / W), rank r
holding [r p, (r + 1) p). A sub-group's (a param group's slice past `sub_group_size`: one inner "param")
partition is its parameters' parts in param_shapes order, so parameter k starts at the sum of p before it
on every rank; each (parameter, rank) with real elements is a chunk (name, [r p, min((r + 1) p, n))).
Checked: partitions are their parts' sum, moments the partition's size, every parameter tiled once. Frozen
parameters come from `frozen_param_fragments` (refused when saved with exclude_frozen_parameters=True).
"""
from __future__ import annotations

import math
import os

import torch

from shardopt.checkpoint import deepspeed_reader
from shardopt.checkpoint.deepspeed_reader import (DeepSpeedSource, _ZERO3_MODEL_FILE, is_zero3, load_file,
                                                  optimizer_files, refuse_parallel_layouts)
from shardopt.files import CheckpointError


def open_deepspeed(directory: str, weights_only: bool = True) -> DeepSpeedSource:
    """The DeepSpeed tag folder `directory` as a checkpoint.Source, whichever ZeRO stage wrote it."""
    if is_zero3(os.listdir(directory)):
        return DeepSpeedZero3Source(directory, weights_only)
    return DeepSpeedSource(directory, weights_only)


def to_torch(directory: str, weights_only: bool = True) -> dict:
    """A DeepSpeed folder (ZeRO-1, 2 or 3) as convert.checkpoint_to_torch's {"model", "optimizer", "extra"}."""
    return deepspeed_reader.to_torch(open_deepspeed(directory, weights_only))


class DeepSpeedZero3Source(DeepSpeedSource):
    """A DeepSpeed ZeRO-3 tag folder as checkpoint.Source (Note [DeepSpeed ZeRO-3 checkpoint files])."""

    def __init__(self, directory: str, weights_only: bool = True):
        self.directory = directory
        names = sorted(os.listdir(directory))
        refuse_parallel_layouts(directory, names)
        models = {}
        for n in names:
            m = _ZERO3_MODEL_FILE.match(n)
            if m:
                if int(m.group(3)) != 0:
                    raise CheckpointError(f"{directory} has {n}: written with tensor/model parallelism, which is "
                                          "not mapped onto shardopt")
                models[int(m.group(2))] = n
        files = optimizer_files(directory, names)
        self.world_size = world = len(files)
        if sorted(models) != list(range(world)):
            raise CheckpointError(f"{directory}: model-state files for ranks {sorted(models)} but optimizer files "
                                  f"for ranks 0..{world - 1}: the checkpoint is incomplete")
        self._models = [load_file(os.path.join(directory, models[r]), weights_only) for r in range(world)]
        self.meta = self._models[0]
        self._check_meta(self.meta)
        self._ranks = [load_file(os.path.join(directory, f), weights_only) for f in files]
        sds = [f["optimizer_state_dict"] for f in self._ranks]
        self._check_zero3(sds)
        self._flat = [sd["fp32_flat_groups"] for sd in sds]
        bases = [sd["optimizer_state_dict"] for sd in sds]
        self._slot_group = self._slot_groups(bases[0])
        self._check_adam(bases, [None] * world)
        self._build_zero3_fragments()
        self._build_model_state()
        self.scaler = self._scaler(sds[0])

    def _check_zero3(self, sds: list) -> None:
        d = self.directory
        for r, sd in enumerate(sds):
            stage = sd.get("zero_stage")
            if stage is None or int(stage) != 3 or "fp32_flat_groups" not in sd:
                raise CheckpointError(f"{d}: rank {r}'s optimizer file is not ZeRO stage 3's (zero_stage {stage}) "
                                      "while the model states are per rank: the folder mixes two checkpoints")
            deepspeed_reader.check_partition_count(
                d, sd, self.world_size, "hpZ / MiCS or expert groups partition over other groups; not mapped onto "
                "shardopt")
            if sd.get("ds_zero_partition_groups"):
                raise CheckpointError(f"{d} holds AutoEP expert-partitioned ZeRO-3 state: experts are partitioned "
                                      "over other groups, which shardopt does not describe")
        slots = len(self.meta["param_shapes"])
        for r, sd in enumerate(sds):
            if len(sd["fp32_flat_groups"]) != slots:
                raise CheckpointError(f"{d}: rank {r} holds {len(sd['fp32_flat_groups'])} flat partitions, "
                                      f"param_shapes lists {slots} sub-groups")

    def _slot_groups(self, base: dict) -> list:
        """Per flat partition (sub-group), the index of its param group, from the inner state dict's groups."""
        slots = len(self.meta["param_shapes"])
        out = [None] * slots
        for g, group in enumerate(base.get("param_groups", ())):
            for i in group.get("params", ()):
                if not 0 <= int(i) < slots or out[int(i)] is not None:
                    raise CheckpointError(f"{self.directory}: the optimizer's param groups list partition {i}, "
                                          f"which is not one of the {slots} sub-groups (or is listed twice)")
                out[int(i)] = g
        if None in out:
            raise CheckpointError(f"{self.directory}: sub-groups {[i for i, g in enumerate(out) if g is None]} are "
                                  "in no optimizer param group: the optimizer state is incomplete")
        return out

    def _build_zero3_fragments(self) -> None:
        world, d = self.world_size, self.directory
        self.params, self._frags = {}, {}
        covered = {}
        for slot, group in enumerate(self.meta["param_shapes"]):
            at = 0
            for name, shape in group.items():
                numel = math.prod(shape)
                self.params[name] = {"shape": list(shape), "group": self._slot_group[slot]}
                part = -(-numel // world)
                covered[name] = 0
                for r in range(world):
                    lo, hi = r * part, min((r + 1) * part, numel)
                    if hi > lo:
                        self._frags.setdefault(name, []).append((lo, hi, r, slot, at))
                        covered[name] += hi - lo
                at += part
            for r in range(world):
                flat = self._flat[r][slot]
                if flat.numel() != at:
                    raise CheckpointError(f"{d}: rank {r}'s partition {slot} holds {flat.numel()} elements; its "
                                          f"parameters' parts come to {at}: not DeepSpeed ZeRO-3's layout")
                for k, v in self._state(r, slot).items():
                    if torch.is_tensor(v) and v.dim() > 0 and v.numel() != at:
                        raise CheckpointError(f"{d}: rank {r}'s {k} of partition {slot} has {v.numel()} elements, "
                                              f"its master partition {at}")
        self._check_tiled(covered)

    def _build_model_state(self) -> None:
        shared = self.meta.get("shared_params") or {}
        buffers = set(self.meta.get("buffer_names") or ())
        self._frozen = {n: tuple(s) for n, s in (self.meta.get("frozen_param_shapes") or {}).items()
                        if n not in self.params}
        self.model_state = {}
        for k, v in self.meta["module"].items():
            if k in self.params or k in shared or not torch.is_tensor(v):
                continue
            if k in self._frozen:
                self.model_state[k] = ("frozen", self._frozen[k])
            elif k in buffers:
                self.model_state[k] = ("buffer", tuple(v.shape))
            elif v.numel() == 0:
                raise CheckpointError(f"{self.directory}: {k!r} is an empty partitioned parameter in 'module' but "
                                      "neither trainable (param_shapes) nor frozen (frozen_param_shapes)")
            else:
                self.model_state[k] = ("frozen", tuple(v.shape))

    def model_tensor(self, name: str) -> torch.Tensor:
        if name not in self._frozen:
            return self.meta["module"][name]
        parts = [m.get("frozen_param_fragments") or {} for m in self._models]
        if any(name not in p for p in parts):
            raise CheckpointError(f"{self.directory} has no partitions of the frozen parameter {name!r} (saved "
                                  "with exclude_frozen_parameters=True): load them from the model's own weights "
                                  "(make them trainable for the load, or load a folder saved with them)")
        shape = self._frozen[name]
        return torch.cat([p[name].reshape(-1) for p in parts])[:math.prod(shape)].reshape(shape)

    def close(self) -> None:
        self._ranks, self._models = [], []
