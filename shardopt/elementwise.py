"""Which torch optimizers may run on flat shards: those whose update of an element depends only on that
element and on scalars. Others (LBFGS, Adafactor, Shampoo, Muon) need whole parameters and are refused."""
from __future__ import annotations

import torch

_ELEMENTWISE: set[type] = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
}


def known_elementwise() -> set[type]:
    from shardopt.cpu_adam import CPUAdam

    return _ELEMENTWISE | {CPUAdam}


def register_elementwise_optimizer(cls: type) -> type:
    """Declares that `cls` updates every element independently, so it may run on shards."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"expected a torch.optim.Optimizer subclass, got {cls!r}")
    _ELEMENTWISE.add(cls)
    return cls


def check_elementwise(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optim must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), got {cls!r}")
    if cls not in known_elementwise():
        known = ", ".join(sorted(c.__name__ for c in known_elementwise()))
        raise ValueError(
            f"{cls.__name__} is not known to be elementwise. ShardedOptimizer runs the inner optimizer on "
            f"flat 1-D slices of parameters, which is wrong for optimizers that need whole parameter shapes "
            f"or global state (LBFGS, Adafactor, Shampoo, Muon, ...). Supported: {known}. If {cls.__name__} "
            f"really updates each element independently, call "
            f"shardopt.register_elementwise_optimizer({cls.__name__}) first.")
