"""Which tensor of a model each key of a weights file is (pure: reads a module's names, touches no values).

Note [Weight names]
-------------------
A weights file names each tensor once; a model may name one several times (an LM head tied to the
embedding), and transformers writes it under the first. So the unit here is the tensor with all its names
(`ModelTensor.names`; a save writes the first), and a load takes it from whichever name the file has.
Two renamings are the default, as transformers and PEFT make them:
  - a PEFT model is its base under `base_model.model.`, an adapted layer's weight under `.base_layer.`, a
    `modules_to_save` layer under `.modules_to_save.<adapter>.` beside `.original_module.`: each is looked
    up under its base name; the adapters' own parameters, absent from a base checkpoint, are `optional`.
  - a model with a task head loads its body's checkpoint and the other way round: `base_model_prefix`
    dropped or added, whichever matches more keys.
Anything else is missing, unexpected or mis-shaped, and the load refuses all three before changing
anything (transformers' `_keys_to_ignore_on_load_*` patterns excepted).
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelTensor:
    """One tensor of a model, with every name the model's state dict gives it."""

    names: tuple[str, ...]
    """Its state-dict keys, in state-dict order (tied weights: several); a save writes names[0]."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    """"param" or "buffer"."""
    optional: bool = False
    """A PEFT adapter's own parameter: absent from a base model's checkpoint, it keeps its values."""


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Which file key every model tensor takes (pure result of `match`)."""

    keys: tuple
    """Per model tensor: the file key it loads from, or None (optional and absent)."""
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[str, ...]
    """'name: model (a, b) vs file (c, d)' lines."""

    def problem(self, where: str) -> str | None:
        """The error message for a refused load, or None."""
        parts = []
        for what, items in (("missing from the file", self.missing), ("not in the model", self.unexpected),
                            ("of another shape", self.mismatched)):
            if items:
                shown = ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")
                parts.append(f"{len(items)} {what}: {shown}")
        if not parts:
            return None
        return (f"{where} does not hold this model's weights: " + "; ".join(parts) + ". Load the checkpoint of "
                "this architecture (and size), or pass strict=False to load the keys that match")


def model_tensors(module: nn.Module, shape_of) -> tuple[list[ModelTensor], list[torch.Tensor]]:
    """Every tensor of `module`'s state dict once, with its names, and the tensors; shape_of(t) gives a tensor's
    true shape (at stage 3 a parameter is an empty tensor between uses)."""
    adapters = peft_adapters(module)
    by_id: dict = {}
    order: list = []
    for key, t in module.state_dict(keep_vars=True).items():
        if not torch.is_tensor(t):
            raise TypeError(f"model state {key!r} is not a tensor (a module's extra state): weights files hold "
                            "tensors only")
        if id(t) not in by_id:
            by_id[id(t)] = []
            order.append(t)
        by_id[id(t)].append(key)
    out = []
    for t in order:
        names = tuple(by_id[id(t)])
        kind = "param" if isinstance(t, nn.Parameter) else "buffer"
        optional = adapters is not None and all(is_adapter_name(n, adapters) for n in names)
        out.append(ModelTensor(names, tuple(shape_of(t)), t.dtype, kind, optional))
    return out, order


def peft_adapters(module: nn.Module) -> tuple[str, ...] | None:
    """The adapter names of a PEFT model (`PeftModel.peft_config`'s keys), or None for any other model."""
    config = getattr(module, "peft_config", None)
    if isinstance(config, dict) and config and hasattr(module, "base_model"):
        return tuple(config)
    return None


def is_adapter_name(name: str, adapters) -> bool:
    """Whether `name` is a PEFT adapter's own parameter (not a base layer, not a modules_to_save copy)."""
    if ".modules_to_save." in name:
        return False  # a copy of a base layer, loaded from its base name
    return any(f".{a}." in name or name.endswith(f".{a}") for a in adapters)


def base_name(name: str, adapters) -> str:
    """A PEFT model's key as the base model's checkpoint names it (Note [Weight names])."""
    if adapters is None:
        return name
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
    for a in adapters:
        name = name.replace(f".modules_to_save.{a}.", ".")
    return name


def transformers_model(module: nn.Module):
    """The first transformers PreTrainedModel in `module` (itself, or a PEFT model's base), or None."""
    for m in module.modules():
        if hasattr(m, "base_model_prefix") and hasattr(m, "config") and hasattr(m, "save_pretrained"):
            return m
    return None


def match(tensors: list[ModelTensor], file_shapes: dict, adapters=None, prefix: str = "",
          ignore_missing=(), ignore_unexpected=()) -> LoadPlan:
    """Which key of a file with `file_shapes` ({key: shape}) each model tensor loads from (Note [Weight names])."""
    best = None
    for rename in _renamings(prefix):
        keys = [_find(t, file_shapes, adapters, rename) for t in tensors]
        found = sum(k is not None for k in keys)
        if best is None or found > best[0]:
            best = (found, keys)
    keys = best[1]
    missing = tuple(t.names[0] for t, k in zip(tensors, keys)
                    if k is None and not t.optional and not _ignored(t.names, ignore_missing))
    used = {k for k in keys if k is not None}
    unexpected = tuple(k for k in file_shapes if k not in used and not _ignored((k,), ignore_unexpected))
    mismatched = tuple(f"{k}: model {tuple(t.shape)} vs file {tuple(file_shapes[k])}" for t, k in zip(tensors, keys)
                       if k is not None and tuple(file_shapes[k]) != tuple(t.shape))
    return LoadPlan(tuple(keys), missing, unexpected, mismatched)


def _renamings(prefix: str):
    yield lambda n: n
    if prefix:
        head = prefix + "."
        yield lambda n: n[len(head):] if n.startswith(head) else n
        yield lambda n: n if n.startswith(head) else head + n


def _find(t: ModelTensor, file_shapes: dict, adapters, rename):
    """The file's key for `t`: one of its own names (a file the model itself wrote), else their base names."""
    for candidates in (t.names, [base_name(n, adapters) for n in t.names]):
        for name in candidates:
            if rename(name) in file_shapes:
                return rename(name)
    return None


def _ignored(names, patterns) -> bool:
    return any(re.search(p, n) for p in patterns or () for n in names)
