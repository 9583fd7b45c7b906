"""DeepSpeed's WarmupLR as a torch LR scheduler, for configs that name it (deepspeed_config.py).

Note [WarmupLR as DeepSpeed steps it]
-------------------------------------
lr = min_lr + (max_lr - min_lr) * gamma(i), gamma(i) = log(i + 1) / log(N) ("log") or i / N ("linear") for
i < N, else 1; N = max(2, warmup_num_steps), i = last_batch_iteration. DeepSpeed's engine steps it after
every optimizer step, so training step k (1, 2, ...) runs with i = k - 2; torch's LRScheduler has
last_epoch = k - 1 there, so i = last_epoch - 1 gives DeepSpeed's lr at every step (tests/test_onebit.py).
"""
from __future__ import annotations

import math

import torch


class WarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR (Note [WarmupLR as DeepSpeed steps it])."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be \"log\" or \"linear\", got {warmup_type!r}")
        n = len(optimizer.param_groups)

        def per_group(v, what):
            if isinstance(v, (list, tuple)):
                if len(v) != n:
                    raise ValueError(f"{what} has {len(v)} values for {n} parameter groups")
                return [float(x) for x in v]
            return [float(v)] * n

        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch=last_batch_iteration + 1 if last_batch_iteration >= 0 else -1)

    def _gamma(self, i: int) -> float:
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            if self.warmup_type == "log":
                return (1.0 / math.log(self.warmup_num_steps)) * math.log(i + 1)  # DeepSpeed's rounding
            return i / self.warmup_num_steps
        return 1.0

    def get_lr(self):
        gamma = self._gamma(self.last_epoch - 1)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]  # min + delta * gamma
