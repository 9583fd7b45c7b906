"""Stage 3's gather rounds: which bucket every rank gathers when (pure: data in, data out).

Reads the layout and the modules' waits (prefetch.plan_forward_waits), talks to no process group; the
sharded store (store.py) walks the rounds.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from torch import nn

from shardopt.layout import Layout
from shardopt.prefetch import ForwardWait


# Note [Stage-3 schedule]
# -----------------------
# At stage 3 a bucket's full parameters exist only while gathered. Which rank
# runs which module can depend on the data (a branch, an MoE expert no token
# reached), but every collective of a process group must be issued in the same
# order on every rank. So module hooks never decide which gather comes next:
# every rank walks one fixed schedule per pass and a hook only moves the walk
# forward to the bucket it needs, then waits.
#   forward round   the non-persistent buckets in the order the forward is
#                   expected to need them (the gather order of Note [Gathering
#                   in the next forward]: modules in registration order);
#   backward round  the same buckets reversed, except that the root module's
#                   own buckets (a head and final norm run after its stack)
#                   come first.
# A hook that needs bucket b issues every gather of the round up to b (plus
# `prefetch` more, while fewer than `max_live` buckets are gathered), waits
# for b, and uses it. A rank that skips a module merely issues that module's
# gathers when a later module moves the walk past them; whatever the walk has
# not reached when the pass ends (the root's forward returns, the backward's
# final callback) is issued then, so each round is the whole schedule on every
# rank and the next round starts in step. Releases are local and need no
# agreement: in forward, a bucket is freed once every outermost module that
# waits for it (not nested in another that does) has returned (`users`), or
# when the forward ends; in backward, once all of its
# parameters have their gradient, or when the backward ends. So the walk
# never asks "is it free?" of a bucket that was gathered when its round began
# (the seam a forward keeps for its backward): a rank that ran every module has
# freed it once its gradients were in, one that skipped a module still holds
# it, and a gather issued by the first alone would hang both. Such a bucket is
# walked past; needed after it was freed, it takes the extra gather below.
# The cost of never hanging is that a skipped module's bucket still crosses
# the link. A module called again within a pass, as often as each rank's data
# says (adaptive depth, an MoE expert per token group), is Note [A module
# called again] in store.py: a forward keeps a bucket its modules are done
# with until a module outside its scope starts, so a module called again at
# once gathers nothing; one that needs a bucket again after it was freed asks
# every rank for it in an exchange that every forward ends with, so the extra
# gathers pair on every rank.
@dataclasses.dataclass(frozen=True)
class Stage3Schedule:
    """Gather rounds of stage 3 (Note [Stage-3 schedule]); pure, the same on every rank."""

    forward: tuple[int, ...]
    """Non-persistent buckets in the order every forward gathers them."""
    backward: tuple[int, ...]
    """The same buckets in the order every backward gathers them."""
    users: tuple[int, ...]
    """Per bucket: how many modules' forwards wait for it, not counting a module whose parent's forward
    encloses it (a forward frees it after the last). nn.MultiheadAttention reads out_proj's weight without
    calling out_proj: only the enclosing module's return says that its buckets are done with."""


def plan_stage3_schedule(layout: Layout, waits: Sequence[ForwardWait]) -> Stage3Schedule:
    """The rounds for a model whose modules wait as `waits` says (plan_forward_waits).

    Forward: buckets in the order modules first wait for them. Backward: first
    the root module's own buckets: the root runs its own layers around its
    stacks, and the ones after them (a final norm, an LM head tied to the
    embedding) are the first a backward needs; then everything else in the
    reverse order of the modules that use it last (for a bucket one module
    uses, reverse forward order). Ordered by first use instead, a bucket every
    layer uses came last, and the first backward module that asked for it
    issued every gather before it at once: most of a LoRA model's frozen base
    (benchmarks/results/2026-11-28-weights-memory.md).
    """
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
    # Backward reaches a bucket at its last user in forward: a bucket shared by every layer (a LoRA model's
    # adapters, packed into one or two small buckets) comes first, not after the whole base (Note above).
    rank = {b: i for i, b in enumerate(forward)}
    backward += tuple(sorted((b for b in forward if b not in backward), key=lambda b: (-last.get(b, -1), -rank[b])))
    return Stage3Schedule(forward=forward, backward=backward, users=tuple(users))


def plan_reuse_scopes(model: nn.Module, waits: Sequence[ForwardWait], most: int) -> tuple[frozenset, ...]:
    """Per wait: the buckets a forward keeps gathered after the module returns, while the modules that start
    need no others (Note [A module called again] in store.py). A module's own buckets; for a module inside an
    nn.Sequential below the root (a block built as a Sequential: its layers wait one by one), the buckets of
    every wait in that Sequential, if at most `most` of them are not the root's own (those are gathered for the
    whole pass anyway), so that the block called again finds
    its first layers' buckets still gathered. Pure: the same on every rank."""
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
