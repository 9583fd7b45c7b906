"""The parameter store: where the managed parameters live, and the one place the stage is decided.

Note [One parameter store]
--------------------------
Stages 1-2 keep every parameter whole in one flat buffer (flat_params.py), stage 3 this rank's chunk of each
bucket (zero3/). The constructor picks the store once and everything else asks it: no branch per module.
"""
from __future__ import annotations

import contextlib

import torch

from shardopt.layout import Layout
from shardopt.prefetch import plan_forward_waits


class ParamStore:
    """What every store answers (Note [One parameter store]). The attributes are set by each store."""

    chunks: list
    """This rank's chunk of every bucket, in the model's dtype: what the master step reads and writes."""
    flat_grad: torch.Tensor | None
    """Stage 1's full-size gradient buffer (each parameter's .grad is a view of it), else None."""
    resting_grads: list
    """Per parameter: what its .grad holds while autograd accumulates (stage 1: its view of flat_grad), or None."""
    waits_in_backward: bool
    """Whether backward may wait for a staging buffer (Note [Stage 3 never waits in backward])."""
    gather: object
    """How every rank's chunks reach every rank, chosen once (Note [One gatherer] in parallel/gathers.py)."""
    holds_whole: bool
    """Whether the model holds every parameter whole between uses (not at stage 3: full_params() then)."""
    tier = None
    """Stage 3's parameter tier (tiers/param_shard.py) with offload_param="nvme", else None."""
    backwards_owed = 0
    """Training forwards whose backward round this rank has not walked yet (stage 3's rounds)."""

    members: list
    """Every parameter the store holds: the optimizer's, then stage 3's frozen ones (zero3/build.py)."""
    every_chunk: list
    """This rank's chunk of every bucket of `layout` (the optimizer's `chunks`, then stage 3's frozen ones)."""
    layout: Layout
    """The layout of `members` (the optimizer's, then stage 3's frozen buckets after it)."""
    rank: int

    @classmethod
    def plan(cls, names: list, world_size: int, config, sizes: tuple[int, int], replicas: int,
             nodes: int, params: list) -> Layout:
        """The layout this store needs (sizes: the reduce and all-gather bucket sizes in elements)."""
        raise NotImplementedError

    def attach(self, waits) -> None:
        """ShardedDDP knows the modules now (prefetch.plan_forward_waits)."""

    def forward_waits(self, module: torch.nn.Module, index: dict, layout: Layout) -> list:
        """The buckets each module's forward waits for (`index`: id -> position in `layout`)."""
        return plan_forward_waits(module, index, layout)

    def adopt(self, module: torch.nn.Module, param_init_fn=None) -> bool:
        """A ShardedDDP takes `module`: gives a meta-device model its values; returns whether it did."""
        return False

    def broadcast(self, src: int, group) -> None:
        """Rank 0's values of the managed parameters everywhere (at wrap time, as DDP does)."""

    def install_hooks(self, wrapper_ref, module: torch.nn.Module, optimizer, waits) -> list:
        """The gradient hooks, and the module and state-dict hooks this store needs; returns their handles."""
        raise NotImplementedError

    def released(self, module: torch.nn.Module, orphaned: bool) -> None:
        """The wrapper's hooks are gone; orphaned: dropped without detach()."""

    def whole_copies(self) -> list | None:
        """detach(): every managed parameter whole in a tensor of its own (a collective), or None."""
        return None

    def end_backward(self) -> None:
        """Autograd's final callback, before gradients are flushed."""

    def settle(self) -> None:
        """Before any step's collective: what this rank owes its peers (stage 3's backward rounds)."""

    def start_step(self) -> None:
        """Every rank is at the step, before its update (Note [Passes every rank agrees on] in zero3/passes.py)."""

    def publish(self, defer: bool) -> None:
        """After a step: every rank's updated chunks into the model (a collective)."""
        raise NotImplementedError

    def wait(self) -> None:
        """Returns once the model holds the last step's values and no rank reads this one's chunks."""

    def wait_buckets(self, buckets) -> None:
        """A module's forward pre-hook (overlap_gather): its buckets have arrived."""

    def moved(self, index: int) -> bool:
        """Whether parameter `index` left where this store put it (Note [Parameters stay in the flat buffer])."""
        raise NotImplementedError

    def all_in_place(self) -> bool:
        """A fast answer for every parameter at once: True if none moved (False: ask moved(i))."""
        return False

    def gathered(self, writeback: bool = True) -> contextlib.AbstractContextManager:
        """Every parameter whole on this rank inside the block (a collective); full_params()."""
        return contextlib.nullcontext()

    def holding(self, b: int, read: bool = True, write: bool = False) -> contextlib.AbstractContextManager:
        """Bucket b's chunk of this rank in memory inside the block (Note [The parameter shard on disk])."""
        return contextlib.nullcontext(self.every_chunk[b])

    def local_parts(self, index: int) -> list:
        """Where this rank holds member `index`: [(lo, hi, writable view)] of its flattened elements, for loads
        (with the parameter tier, iterate once: each view is valid until the next)."""
        if getattr(self, "_holding", None) is None:
            self._holding = [[] for _ in self.layout.params]
            for b in self.layout.buckets:
                for i in b.params:
                    self._holding[i].append(b.index)
        slot, out = self.layout.params[index], []
        for b in self._holding[index]:
            bucket = self.layout.buckets[b]
            cs, ce = bucket.chunk(self.rank)
            s, e = max(cs, slot.offset), min(ce, slot.end)
            if s < e:
                out.append((s - slot.offset, e - slot.offset, self.every_chunk[b][s - cs:e - cs]))
        return out

    def stream(self, indices):
        """(index, whole value) of members `indices` in turn; at stage 3 a collective iterated to its end."""
        for i in indices:
            yield i, self.members[i].detach()

    def after_load(self) -> None:
        """A load wrote local_parts() and the optimizer published: what else the model must take."""

    def resting_shape(self, index: int) -> tuple:
        """Parameter `index`'s shape between uses (what its p.grad's stand-in must match)."""
        return tuple(self.layout.params[index].shape)

    def param_bytes(self) -> int:
        raise NotImplementedError
