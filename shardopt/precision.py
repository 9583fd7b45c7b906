"""Loss scaling for fp16 training, and what to do when gradients are not finite.

The cross-rank part (every rank learning that some rank saw an inf/nan) rides on
the one small all-reduce the optimizer already does before each step (see
GradSync.finish in grad_sync.py); this module is the single-process logic.

Note [Unscaling inside the reduction]
-------------------------------------
Gradients arrive scaled by the loss scale S. The bucket engine already divides
every gradient by the world size N while copying it into the reduce buffer (as
DDP's default hook does); it divides by N*S instead, so the reduced shard holds
true, unscaled gradients with no extra pass, and the same copy pass checks for
inf/nan (csrc/precision/unscale.cpp, csrc/cuda/unscale.cu; reference in
shardopt/reference.py). A rank that saw an inf/nan raises a flag that the
pre-step all-reduce turns into a decision every rank shares: all skip, or none.
"""
from __future__ import annotations

import dataclasses

import torch

NONFINITE_ACTIONS = ("auto", "skip", "raise")


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic (or static) loss scaling for fp16 parameters.

    Dynamic scaling: after `growth_interval` steps in a row without inf/nan the
    scale is multiplied by `growth_factor`; an inf/nan skips the step, and every
    `hysteresis`-th such skip (since the scale last changed) multiplies the scale by
    `backoff_factor`, never below `min_scale`. With the default hysteresis=1
    this is torch.amp.GradScaler's rule; DeepSpeed's fp16 block uses 2.
    """

    init_scale: float = 2.0 ** 16
    """Scale of the first step."""
    growth_factor: float = 2.0
    """Multiplier applied after growth_interval clean steps (> 1)."""
    backoff_factor: float = 0.5
    """Multiplier applied on overflow (in (0, 1))."""
    growth_interval: int = 1000
    """Consecutive steps without inf/nan before the scale grows."""
    hysteresis: int = 1
    """Overflows tolerated (each still skips its step) before the scale backs off."""
    min_scale: float = 1.0
    """The scale never drops below this."""
    dynamic: bool = True
    """False: the scale stays init_scale (overflowing steps are still skipped)."""

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"LossScaleConfig.{name}={getattr(self, name)!r}: {why}")
        if not self.init_scale > 0:
            bad("init_scale", "must be > 0 (e.g. 2.0**16)")
        if not self.growth_factor > 1:
            bad("growth_factor", "must be > 1 (e.g. 2.0)")
        if not 0 < self.backoff_factor < 1:
            bad("backoff_factor", "must be in (0, 1) (e.g. 0.5)")
        for name in ("growth_interval", "hysteresis"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "must be a whole number >= 1")
        if not 0 < self.min_scale <= self.init_scale:
            bad("min_scale", f"must be in (0, init_scale={self.init_scale}]")


def resolve_loss_scale(loss_scale, param_dtype: torch.dtype) -> LossScaleConfig | None:
    """The user's `loss_scale` argument as a config (None: no loss scaling)."""
    if isinstance(loss_scale, str):
        if loss_scale == "auto":
            return LossScaleConfig() if param_dtype == torch.float16 else None
        if loss_scale == "dynamic":
            return LossScaleConfig()
        raise ValueError(f"loss_scale must be 'auto', 'dynamic', None, a number or a shardopt.LossScaleConfig, "
                         f"got {loss_scale!r}")
    if loss_scale is None or isinstance(loss_scale, LossScaleConfig):
        return loss_scale
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return LossScaleConfig(init_scale=float(loss_scale), min_scale=float(loss_scale), dynamic=False)
    raise TypeError(f"loss_scale must be 'auto', 'dynamic', None, a number or a shardopt.LossScaleConfig, "
                    f"got {type(loss_scale).__name__}")


def resolve_nonfinite(nonfinite: str, scaled: bool) -> str:
    """'skip' or 'raise': with a loss scaler overflow is routine and skipped; without, it means divergence."""
    if nonfinite not in NONFINITE_ACTIONS:
        raise ValueError(f"nonfinite must be one of {NONFINITE_ACTIONS}, got {nonfinite!r}")
    if nonfinite == "auto":
        return "skip" if scaled else "raise"
    return nonfinite


class LossScaler:
    """The scale's state machine. Identical on every rank: it is fed the shared overflow decision."""

    def __init__(self, config: LossScaleConfig):
        self.config = config
        self.scale = float(config.init_scale)
        self._clean_steps = 0                       # steps without overflow since the scale changed
        self._overflows_left = config.hysteresis    # overflows until the next backoff

    def update(self, overflow: bool) -> None:
        c = self.config
        if not c.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale * c.backoff_factor, c.min_scale)
                self._overflows_left = c.hysteresis
        else:
            self._clean_steps += 1
            if self._clean_steps >= c.growth_interval:
                self.scale *= c.growth_factor
                self._clean_steps = 0
                self._overflows_left = c.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left,
                "config": dataclasses.asdict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "clean_steps", "overflows_left"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state is missing {sorted(missing)}")
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
