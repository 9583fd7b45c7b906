"""Which buckets each module's forward waits for when parameters are gathered in the next forward.

Pure planning: reads the module tree and the layout, talks to no process group.
ShardedDDP installs the hooks (ddp.py), the bucket engine runs the gathers.

Note [Gathering in the next forward]
------------------------------------
After a step every rank must all-gather the chunks the others updated. Done
inside step() (overlap_gather=False) that collective is exposed: nothing else
runs while it does. With overlap_gather=True, step() only *starts* the
gathers, one per span, in the order the next forward is expected to need
them, and returns. Each module's forward pre-hook then waits for the buckets
holding the parameters it may touch, so block k's forward computes while the
buckets of blocks k+1... are still on the wire (FSDP's forward prefetch,
without FSDP's wrapping: the unit is the module call).

Which parameters may a module's forward touch? Its own, and those of the
submodules it could read directly instead of calling (nn.MultiheadAttention
reads `out_proj.weight` without calling `out_proj`). So a module waits for the
parameters of its whole subtree, except below a *container* (ModuleList,
Sequential, ModuleDict): a container's children are run one by one (or read
as a list of modules) and wait for themselves, which is what lets a stack of
blocks overlap at all. A container itself waits only for parameters it holds
directly. The assumption this rests on: code does not read the parameters of
a container's child without calling that child (or an ancestor of it below
the container). The root's post-forward hook waits for everything left, so
whatever runs after the forward (the loss, the backward) sees final values.

Outside a forward, parameters may still be in flight between step() and the
next forward. Everything shardopt offers that reads or writes them waits
first: the next step(), `opt.wait_params()`, the model's state_dict() and
load_state_dict() (hooks on every module that waits), checkpoints,
consolidate_state_dict(). Code that reads parameters directly right after
step() (an EMA over `model.parameters()`, logging weight norms) must call
`opt.wait_params()` first; that is why overlap_gather is opt-in.

Gather order: the modules in registration order (the order most forwards run
them in), each contributing the buckets of its wait set not yet listed; a
bucket nobody waits for goes last. Every rank computes the same order from the
same (checked) model and layout, as collectives require.
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
    """The module itself."""
    buckets: tuple[int, ...]
    """Buckets holding a parameter its forward may touch (Note [Gathering in the next forward])."""
    covered: bool = False
    """Its parent is a module that is not a container, so the parent's forward, which encloses this one,
    waits for all of these buckets too (stage 3 frees after the enclosing forward: Note [Stage-3 schedule] in zero3/schedule.py)."""


def _wait_set(module: nn.Module, index: dict[int, int]) -> list[int]:
    """Managed parameter indices a module's forward may touch (see the Note)."""
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
    """Every module with something to wait for, in registration order.

    `index` maps id(parameter) to its position in `layout.params`.
    """
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
