"""Host-side pieces of optimizer offload: where chunks are allocated, which optimizer steps them,
and handing the CPU Adam kernel the model copy it should write.

The copies themselves are per bucket: gradients into the host shard as each
reduce-scatter finishes (the bucket engine), updated chunks back into the
model before the all-gather (ShardedOptimizer._publish_params; see Note
[Master weights] in optimizer.py).
"""
from __future__ import annotations

import torch

from shardopt.device_ops import DeviceOps

# torch.optim.AdamW's default, which the offload default (CPUAdam) must match.
_ADAMW_DEFAULT_WEIGHT_DECAY = 0.01


def default_optimizer(optim, optim_kwargs: dict, offload: str):
    """The inner optimizer class and kwargs: AdamW semantics by default, on the fused CPU Adam when offloaded."""
    if optim is not None:
        return optim, optim_kwargs
    if offload != "cpu":
        return torch.optim.AdamW, optim_kwargs
    from shardopt.cpu_adam import CPUAdam

    kwargs = dict(optim_kwargs)
    kwargs.setdefault("weight_decay", _ADAMW_DEFAULT_WEIGHT_DECAY)
    kwargs.setdefault("adamw", True)
    return CPUAdam, kwargs


def zeros(numel: int, dtype: torch.dtype, device: torch.device, pin: bool, ops: DeviceOps) -> torch.Tensor:
    """A zeroed 1-D buffer; pinned host memory when asked and possible (pinning needs a CUDA runtime)."""
    if pin and device.type == "cpu" and ops.can_pin():
        return ops.pinned_zeros(numel, dtype)
    return torch.zeros(numel, dtype=dtype, device=device)


def copy_back_is_async(model_chunk: torch.Tensor, master_chunk: torch.Tensor, ops: DeviceOps) -> bool:
    """Whether the step's master -> model copy can leave the host free: host master, device model, pinned.

    Then the host must not write the master chunk again (the next step) before
    the device has read it: ShardedOptimizer marks the copies and wait_params()
    waits for the mark (Note [Device operations behind an interface] in
    device_ops.py). From pageable memory the copy blocks anyway.
    """
    return ops.is_device_memory(model_chunk) and not ops.is_device_memory(master_chunk) \
        and ops.is_pinned(master_chunk)


def attach_lowp_copies(inner, masters, model_views, *, separate_master: bool) -> bool:
    """Asks a CPU Adam inner optimizer to write each updated master piece into the model's bf16/fp16 view.

    Returns True when it will, so the optimizer skips its own cast-and-copy.
    Only possible when the model's buffer is host memory of a low-precision
    dtype (on a CUDA model the copy must cross to the device anyway).
    """
    from shardopt.cpu_adam import CPUAdam

    if inner is None or not separate_master or not isinstance(inner, CPUAdam):
        return False
    if not hasattr(inner, "set_lowp_copies") or not model_views:
        return False
    view = model_views[0]
    if view.device.type != "cpu" or view.dtype not in (torch.bfloat16, torch.float16):
        return False
    inner.set_lowp_copies(list(zip(masters, model_views)))
    return True
