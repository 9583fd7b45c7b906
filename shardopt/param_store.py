"""The parameter store: where the managed parameters live, and the one place the stage is decided.

Note [One parameter store]
--------------------------
What differs between the stages is where a parameter's values live between uses, and so what it takes to
use them:
  stages 1-2  every parameter is a view into one flat buffer of the model's dtype, whole on every rank;
              after a step every rank's updated chunks are all-gathered into it (flat_params.py);
              stage 1 also keeps full-size gradients in a flat buffer until the step.
  stage 3     each rank holds only its chunk of every bucket; a bucket's full parameters exist only
              while a module uses them (zero3/: the sharded store, its schedule, its module hooks).
ShardedOptimizer's constructor picks the store once (its one comparison of the stage); from then on
nothing asks which stage it is: the optimizer, ShardedDDP, the gradient sync and the publisher ask the store, and both stores
answer the same questions (the interface below). Planning the layout is the store's too: stage 3 cuts
buckets at parameter boundaries and keeps tiny parameters gathered (Note [Stage-3 buckets hold whole
parameters] in layout.py), stages 1-2 cut anywhere. So a new kind of store (parameters offloaded to the
host, frozen parameters sharded, weights streamed in and out) is one more implementation, not a branch in
every room.
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
    """Per parameter: what its .grad holds while autograd accumulates (stage 1: its view of flat_grad), or
    None (the full-size gradient is released once it is reduced)."""
    waits_in_backward: bool
    """Whether backward may wait for a staging buffer (stage 3 never does: Note [Stage 3 never waits in
    backward] in csrc/comm/bucket_engine.cpp)."""
    shared_gather = None
    """The gather after a step through shared memory on one host (parallel/shared_flat.SharedGather) where
    the store uses one (stages 1-2, Note [Gathering through shared memory]), else None."""
    holds_whole: bool
    """Whether the model holds every parameter whole between uses. Where not (stage 3: a parameter is an
    empty tensor between uses), code that reads weights outside a forward needs full_params(), and an
    in-place edit outside it does nothing, so it is refused where seen (Note [Weights edited in place] in
    optimizer.py)."""

    members: list
    """Every parameter the store holds: the optimizer's first (members[j] is layout.params[j]), then at stage 3
    the frozen ones it shards (Note [Frozen parameters at stage 3] in zero3/store.py)."""
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

    # -------------------------------------------------------------- life cycle
    def attach(self, waits) -> None:
        """ShardedDDP knows the modules now (prefetch.plan_forward_waits)."""

    def forward_waits(self, module: torch.nn.Module, index: dict, layout: Layout) -> list:
        """The buckets each module's forward waits for (prefetch.plan_forward_waits over the optimizer's
        parameters, `index`: id -> position in `layout`; stage 3 adds its frozen buckets)."""
        return plan_forward_waits(module, index, layout)

    def adopt(self, module: torch.nn.Module, param_init_fn=None) -> bool:
        """A ShardedDDP takes `module`: give it values where it has none (a meta-device model); returns whether
        it did (the masters then take them)."""
        return False

    def broadcast(self, src: int, group) -> None:
        """Rank 0's values of the managed parameters everywhere (at wrap time, as DDP does)."""

    def install_hooks(self, wrapper_ref, module: torch.nn.Module, optimizer, waits) -> list:
        """The gradient hooks, and the module and state-dict hooks this store needs; returns their handles."""
        raise NotImplementedError

    def released(self, module: torch.nn.Module, orphaned: bool) -> None:
        """The wrapper's hooks are gone; orphaned: dropped without detach()."""

    def whole_copies(self) -> list | None:
        """detach(): every managed parameter whole in a tensor of its own (a collective), or None if the
        model holds them whole anyway."""
        return None

    # ---------------------------------------------------------------- a step
    def end_backward(self) -> None:
        """Autograd's final callback, before gradients are flushed."""

    def settle(self) -> None:
        """Before any step's collective: what this rank owes its peers (stage 3's backward rounds)."""

    def start_step(self) -> None:
        """After the step's gradient collectives, before its update: every rank is at the step (stage 3's
        pass agreement, Note [Passes every rank agrees on] in zero3/passes.py)."""

    def publish(self, defer: bool) -> None:
        """After a step: every rank's updated chunks into the model (a collective)."""
        raise NotImplementedError

    def wait(self) -> None:
        """Returns once the model holds the last step's values and no rank reads this one's chunks."""

    def wait_buckets(self, buckets) -> None:
        """A module's forward pre-hook (overlap_gather): its buckets have arrived."""

    # ------------------------------------------------------------- questions
    def moved(self, index: int) -> bool:
        """Whether parameter `index` no longer lives where this store put it (Note [Parameters stay in the
        flat buffer] in optimizer.py)."""
        raise NotImplementedError

    def all_in_place(self) -> bool:
        """A fast answer for every parameter at once: True if none moved (False: ask moved(i))."""
        return False

    def gathered(self, writeback: bool = True) -> contextlib.AbstractContextManager:
        """Every parameter whole on this rank inside the block (a collective); full_params()."""
        return contextlib.nullcontext()

    # ------------------------------------------------------ weights in and out
    def local_parts(self, index: int) -> list:
        """Where this rank holds member `index` between steps: [(lo, hi, view)], its flattened elements
        [lo, hi) in this rank's chunks, the views writable. A load writes them and the optimizer publishes
        (Note [Weights streamed in and out] in weights/stream.py)."""
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
        """Members `indices` whole, (index, value) one after the other; at stage 3 gathered bucket by bucket
        (each value a copy), a collective every rank iterates to its end."""
        for i in indices:
            yield i, self.members[i].detach()

    def after_load(self) -> None:
        """A load wrote local_parts() and the optimizer published: what else the model must take."""

    def resting_shape(self, index: int) -> tuple:
        """Parameter `index`'s shape between uses (what its p.grad's stand-in must match)."""
        return tuple(self.layout.params[index].shape)

    def param_bytes(self) -> int:
        """Bytes of parameters this rank holds now (memory_stats()["params"])."""
        raise NotImplementedError
