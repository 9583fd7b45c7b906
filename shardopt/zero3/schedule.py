"""Stage 3's gather rounds: which bucket every rank gathers when (pure: the layout and the modules' waits in,
rounds out; rounds.py walks them)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from torch import nn

from shardopt.layout import Layout
from shardopt.prefetch import ForwardWait


# Note [Stage-3 schedule]
# Which modules a rank runs can depend on its data, but collectives must be issued in the same order everywhere.
# So every rank walks one fixed schedule per pass (forward: the order of Note [Gathering in the next forward];
# backward: the root's buckets, then by last use reversed); a hook needing bucket b issues the gathers up to b
# plus `prefetch`, and what a rank skipped is issued as the walk passes it or the pass ends (its bucket still
# crosses the link: the cost of never hanging). A bucket gathered when its round began (the seam) is walked past.
@dataclasses.dataclass(frozen=True)
class Stage3Schedule:
    """Gather rounds of stage 3 (Note [Stage-3 schedule]); pure, the same on every rank."""

    forward: tuple[int, ...]
    """Non-persistent buckets in the order every forward gathers them."""
    backward: tuple[int, ...]
    """The same buckets in the order every backward gathers them."""
    users: tuple[int, ...]
    """Per bucket: how many outermost modules' forwards wait for it (freed after the last returns)."""


def plan_stage3_schedule(layout: Layout, waits: Sequence[ForwardWait]) -> Stage3Schedule:
    """The rounds for modules that wait as `waits` says. Backward goes by last use: by first use a bucket every
    layer uses (LoRA adapters) would come last, and asking for it would issue every gather before it at once."""
    order: list[int] = []
    users = [0] * len(layout.buckets)
    outer: list[int] = []
    last: dict[int, int] = {}  # bucket -> the last wait (in module order) that uses it
    for k, w in enumerate(waits):
        for b in w.buckets:
            users[b] += not w.covered
            last[b] = k
            if b not in order:
                order.append(b)
            if w.name == "" and b not in outer:
                outer.append(b)
    order += [b.index for b in layout.buckets if b.index not in order]
    forward = tuple(b for b in order if not layout.buckets[b].persistent)
    backward = tuple(b for b in outer if not layout.buckets[b].persistent)
    rank = {b: i for i, b in enumerate(forward)}
    backward += tuple(sorted((b for b in forward if b not in backward), key=lambda b: (-last.get(b, -1), -rank[b])))
    return Stage3Schedule(forward=forward, backward=backward, users=tuple(users))


def plan_reuse_scopes(model: nn.Module, waits: Sequence[ForwardWait], most: int) -> tuple[frozenset, ...]:
    """Per wait: the buckets kept after the module returns (Note [A module called again] in rounds.py): its own,
    or those of its whole nn.Sequential block (at most `most`), so a block called again finds them gathered."""
    modules = dict(model.named_modules())
    inside: dict[str, set] = {}
    for w in waits:
        parent = w.name.rpartition(".")[0]
        while parent:  # every Sequential the wait lies in, below the root
            if isinstance(modules.get(parent), nn.Sequential):
                inside.setdefault(parent, set()).update(w.buckets)
            parent = parent.rpartition(".")[0]
    root = {b for w in waits if w.name == "" for b in w.buckets}  # gathered for the whole pass anyway
    scopes = []
    for w in waits:
        parent = w.name.rpartition(".")[0]
        block = inside.get(parent) if parent else None
        scopes.append(frozenset(block) if block is not None and len(block - root) <= most else frozenset(w.buckets))
    return tuple(scopes)
