"""shardopt: ZeRO-style sharded optimizer for PyTorch.

Public API only; each name is implemented in its own module.
"""
import torch  # noqa: F401  (torch must be loaded before the extension)

from shardopt._ext import _C
from shardopt import _ops  # noqa: F401  (fake kernels of the torch.ops.shardopt ops)
from shardopt.checkpoint.save_load import load_checkpoint, save_checkpoint
from shardopt.checkpoint import dcp  # noqa: F401  (shardopt.dcp.get_state_dict / set_state_dict)
from shardopt.checkpoint.files import CheckpointError
from shardopt.config import ShardConfig
from shardopt.cpu_adam import CPUAdam
from shardopt.ddp import ShardedDDP
from shardopt.elementwise import register_elementwise_optimizer
from shardopt.lr_schedules import WarmupLR
from shardopt.onebit import OneBitAdam
from shardopt.optimizer import ShardedOptimizer
from shardopt.precision import LossScaleConfig


def cpu_features():
    """Which SIMD variant the CPU kernels run with.

    Returns a dict: ``active`` (the variant used now), ``best`` (what this CPU
    and build support best; the default unless SHARDOPT_ISA pins another) and
    ``supported`` (every variant this CPU can run, best last).
    """
    return {"active": _C.active_isa(), "best": _C.best_isa(), "supported": list(_C.supported_isas())}


__all__ = ["CPUAdam", "CheckpointError", "LossScaleConfig", "OneBitAdam", "WarmupLR", "ShardConfig", "ShardedDDP", "ShardedOptimizer",
           "cpu_features", "load_checkpoint", "register_elementwise_optimizer", "save_checkpoint"]
__version__ = "0.1.0"
