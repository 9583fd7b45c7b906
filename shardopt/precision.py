"""Loss scaling for fp16 training, and what to do when gradients are not finite.

The single-process logic; every rank learns of an inf/nan through the pre-step all-reduce (GradSync.finish).

Note [Unscaling inside the reduction]
-------------------------------------
The bucket engine divides every gradient by the world size N while copying it into the reduce buffer, as
DDP's hook does; with loss scale S it divides by N*S, so the reduced shard holds unscaled gradients with no
extra pass, and the same pass checks for inf/nan (csrc/precision/, reference.py). A rank's flag becomes,
through the pre-step all-reduce, a decision every rank shares: all skip, or none.
"""
from __future__ import annotations

import dataclasses

import torch

NONFINITE_ACTIONS = ("auto", "skip", "raise")


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """Loss scaling for fp16: the scale grows by `growth_factor` after `growth_interval` clean steps; an inf/nan
    skips the step, and every `hysteresis`-th skip (GradScaler: 1, DeepSpeed: 2) multiplies it by
    `backoff_factor`, down to `min_scale`. dynamic=False keeps init_scale (and still skips)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 1
    min_scale: float = 1.0
    dynamic: bool = True

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
