"""Loads into a wrapped model reach the master weights (both stores install these hooks)."""
from __future__ import annotations

import torch


def install_load_hooks(module: torch.nn.Module, optimizer) -> list:
    """Hooks that keep the masters in step with a state dict loaded into `module` (Note below)."""
    same, finer = [], {}
    return [module.register_load_state_dict_pre_hook(same_values_hook(optimizer, same, finer)),
            module.register_load_state_dict_post_hook(lambda mod, keys: masters_after_load(optimizer, same, finer))]


# Note [A load of the values held]
# --------------------------------
# With separate master weights (a bf16/fp16 model, offload: Note [Master weights] in master_step.py), a
# state dict loaded into the model is the new truth: the masters take the loaded values whole (at stage
# 3 as well), or the next step would publish the old ones over them. A load that changes no value is
# different: code that puts the model's own weights back (Lightning's WeightAveraging on resume, a
# checkpoint reloaded into the process that wrote it) would round a bf16 model's fp32 masters to bf16,
# where under DDP such a load changes nothing. So before a load, the values it brings are compared with
# the managed parameters' (in the model's dtype, as the load will write them; parameters it leaves out
# count as unchanged); if none differs, the masters keep their bits. One compare pass per load.
# A loaded value finer than the model's dtype (an fp32 checkpoint, pretrained weights, into a bf16 model)
# holds more than the model can: the masters take it at their own precision, not the model's rounding of
# it (which the load writes into the model), whether or not that rounding changed the model. So a bf16
# model wrapped first and loaded after starts from the file's fp32 values (a plain checkpoint loaded by the
# Lightning strategy too), as FSDP2's sharded fp32 parameters would; the model holds their rounding, as
# after any step.
def same_values_hook(optimizer, same: list, finer: dict):
    def hook(mod, state_dict, prefix, *args):
        with torch.no_grad():
            values = [(p, state_dict.get(prefix + name)) for name, p in mod.named_parameters()
                      if id(p) in optimizer._index]
            same[:] = [all(_holds(p, value) for p, value in values)]
            finer.clear()
            finer.update((optimizer._index[id(p)], value) for p, value in values if _finer(value, p))
    return hook


def _holds(p: torch.Tensor, value) -> bool:
    if not torch.is_tensor(value):
        return value is None  # not in the state dict: the load leaves it
    return value.shape == p.shape and torch.equal(value.to(device=p.device, dtype=p.dtype), p.detach())


def _finer(value, p: torch.Tensor) -> bool:
    """Whether a loaded value carries more precision than the parameter's dtype (an fp32 value, a bf16 model)."""
    return torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape \
        and torch.finfo(value.dtype).eps < torch.finfo(p.dtype).eps


def masters_after_load(optimizer, same: list, finer: dict) -> None:
    if same and same.pop():
        optimizer._note_model_version()  # the load wrote what was there: nothing to take
    else:
        optimizer._load_master_from_model()
    if finer:
        optimizer._load_master_from_values(finer)  # more than the model holds: at master precision
        finer.clear()
