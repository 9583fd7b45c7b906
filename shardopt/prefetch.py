"""Which buckets each module's forward waits for when parameters are gathered in the next forward (pure planning).

Note [Gathering in the next forward]
------------------------------------
With overlap_gather=True, step() only starts the all-gathers, in the order the next forward should need them,
and each module's forward pre-hook waits for the buckets it may touch: its subtree's (nn.MultiheadAttention
reads `out_proj.weight` without calling it), except below a container (ModuleList, Sequential, ModuleDict),
whose children wait for themselves, so a stack of blocks overlaps. Other reads need `opt.wait_params()`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from torch import nn

from shardopt.layout import Layout

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclasses.dataclass(frozen=True)
class ForwardWait:
    """One module whose forward pre-hook waits for some buckets."""

    name: str
    """The module's qualified name in the model ('' for the root)."""
    module: nn.Module
    buckets: tuple[int, ...]
    """Buckets holding a parameter its forward may touch (Note [Gathering in the next forward])."""
    covered: bool = False
    """Its parent is not a container, so the parent's enclosing forward waits for these buckets too."""


def _wait_set(module: nn.Module, index: dict[int, int]) -> list[int]:
    out = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
    if isinstance(module, CONTAINERS):
        return out
    stack = [c for c in module.children() if not isinstance(c, CONTAINERS)]
    while stack:
        m = stack.pop()
        out += [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
        stack += [c for c in m.children() if not isinstance(c, CONTAINERS)]
    return out


def plan_forward_waits(model: nn.Module, index: dict[int, int], layout: Layout) -> list[ForwardWait]:
    """Every module with something to wait for, in registration order (`index`: id(p) -> its layout position)."""
    param_buckets: list[list[int]] = [[] for _ in layout.params]
    for b in layout.buckets:
        for i in b.params:
            param_buckets[i].append(b.index)
    modules = dict(model.named_modules())
    waits = []
    for name, module in modules.items():
        buckets = sorted({b for i in _wait_set(module, index) for b in param_buckets[i]})
        if buckets:
            parent = modules[name.rpartition(".")[0]] if name else None
            covered = parent is not None and not isinstance(parent, CONTAINERS)
            waits.append(ForwardWait(name, module, tuple(buckets), covered))
    return waits


def plan_gather_order(layout: Layout, waits: Sequence[ForwardWait]) -> tuple[int, ...]:
    """Indices into layout.gather_spans in the order every rank starts them (see the Note)."""
    rank_of: dict[int, int] = {}
    for w in waits:
        for b in w.buckets:
            rank_of.setdefault(b, len(rank_of))
    spans = range(len(layout.gather_spans))
    return tuple(sorted(spans, key=lambda s: (rank_of.get(layout.gather_spans[s].bucket, len(rank_of)),
                                              layout.gather_spans[s].bucket, layout.gather_spans[s].lo)))
