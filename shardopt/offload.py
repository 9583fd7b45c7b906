"""Host-side pieces of optimizer offload: where chunks are allocated, which optimizer steps them,
and handing the CPU Adam kernel the model copy it should write.

The copies themselves are per bucket: gradients into the host shard as each
reduce-scatter finishes (the bucket engine), updated chunks back into the
model before the all-gather (ShardedOptimizer._publish_params; see Note
[Master weights] in optimizer.py).
"""
from __future__ import annotations

import torch

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


def zeros(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """A zeroed 1-D buffer; pinned host memory when asked and CUDA exists (pinning needs a CUDA runtime)."""
    if pin and device.type == "cpu" and torch.cuda.is_available():
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    return torch.zeros(numel, dtype=dtype, device=device)


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
