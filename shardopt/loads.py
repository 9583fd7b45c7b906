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
# With separate masters (Note [Master weights] in master_step.py) a state dict loaded into the model is the
# new truth: the masters take it whole, or the next step would publish the old values over it. But a load
# that changes no value (Lightning's WeightAveraging on resume, a checkpoint reloaded by its writer) would
# round fp32 masters to bf16 where under DDP it changes nothing; so the values are compared first (in the
# model's dtype; left-out parameters count as unchanged), and if none differs the masters keep their bits.
# A value finer than the model's dtype (fp32 weights into a bf16 model) goes to the masters at their own
# precision, as FSDP2's sharded fp32 parameters would take it; the model holds its rounding.
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
