"""shardopt: ZeRO-style sharded optimizer for PyTorch. Public API only; each name lives in its own module."""
import torch  # noqa: F401  (torch must be loaded before the extension)

from shardopt._ext import cpu_features
from shardopt import _ops  # noqa: F401  (fake kernels of the torch.ops.shardopt ops)
from shardopt.checkpoint.save_load import load_checkpoint, save_checkpoint
from shardopt.checkpoint import dcp  # noqa: F401  (shardopt.dcp.get_state_dict / set_state_dict)
from shardopt.files import CheckpointError
from shardopt.config import ShardConfig
from shardopt.cpu_adam import CPUAdam
from shardopt.ddp import ShardedDDP
from shardopt.elementwise import register_elementwise_optimizer
from shardopt.lr_schedules import WarmupLR
from shardopt.onebit import OneBitAdam
from shardopt.optimizer import ShardedOptimizer
from shardopt.precision import LossScaleConfig
from shardopt.tiers.disk import TierError
from shardopt.view import wrapper_of
from shardopt.weights import WeightsError, from_pretrained, load_weights, save_weights
from shardopt.zero3.inference import ShardedInference, shard_for_inference


__all__ = ["CPUAdam", "CheckpointError", "LossScaleConfig", "OneBitAdam", "WarmupLR", "ShardConfig", "ShardedDDP", "ShardedInference", "ShardedOptimizer",
           "TierError", "WeightsError", "cpu_features", "from_pretrained", "load_checkpoint", "load_weights", "register_elementwise_optimizer",
           "save_checkpoint", "save_weights", "shard_for_inference", "wrapper_of"]
__version__ = "0.1.0"
