"""Host-side pieces of optimizer offload: where chunks are allocated, which optimizer steps them, and the
model copy the CPU Adam kernel writes (Note [Master weights] in master_step.py)."""
from __future__ import annotations

import torch

from shardopt.device_ops import DeviceOps

# torch.optim.AdamW's, which CPUAdam as the offload default must match.
_ADAMW_DEFAULT_WEIGHT_DECAY = 0.01


def default_optimizer(optim, optim_kwargs: dict, offload: str):
    """The inner optimizer class and kwargs: AdamW semantics by default, on the fused CPU Adam when offloaded."""
    if optim is not None:
        return optim, optim_kwargs
    if offload not in ("cpu", "nvme"):
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
    """Whether the master -> model copy leaves the host free (pinned host master, device model): then waited for."""
    return ops.is_device_memory(model_chunk) and not ops.is_device_memory(master_chunk) \
        and ops.is_pinned(master_chunk)


def writes_lowp(inner, model_views, *, separate_master: bool) -> bool:
    """Whether a CPUAdam inner optimizer can write each updated master piece into the model's bf16/fp16 host
    view in the same pass (the optimizer then skips its own cast-and-copy)."""
    from shardopt.cpu_adam import CPUAdam

    if inner is None or not separate_master or not isinstance(inner, CPUAdam):
        return False
    if not hasattr(inner, "set_lowp_copies") or not model_views:
        return False
    view = model_views[0]
    return view.device.type == "cpu" and view.dtype in (torch.bfloat16, torch.float16)


def attach_lowp_copies(inner, masters, model_views, *, separate_master: bool) -> bool:
    """Asks a CPUAdam inner optimizer to write each updated master piece into the model's bf16/fp16 host
    view (writes_lowp); True when it will."""
    if not writes_lowp(inner, model_views, separate_master=separate_master):
        return False
    inner.set_lowp_copies(list(zip(masters, model_views)))
    return True
