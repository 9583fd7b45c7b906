"""Which pass every rank starts next, agreed before its gathers (stage 3).

Note [Passes every rank agrees on]
----------------------------------
Every stage-3 pass walks the whole schedule, so ranks stay in step if they run the same passes; but forwards
without gradients may differ in number. So before each pass the ranks all-gather which pass each starts
(`Intent`; on one host: Note [Agreements in shared memory] in parallel/shm_exchange.py). Where some LOOK, the
others walk its gathers without computing (`shadow_look`); any other mismatch raises on every rank.
"""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist


class Intent(enum.IntEnum):
    """What a rank starts next (Note [Passes every rank agrees on])."""
    LOOK = 1      # a forward without gradients: other ranks may shadow it
    FORWARD = 2   # a forward that will be differentiated
    STEP = 4      # the optimizer step (after every backward round this rank owes)
    AGAIN = 8     # not a pass: the end of a forward, serving gathers asked again (Note [A module called again])
    SYNC = 16     # not a pass: a model sharded for inference catches up with its peers' forwards (inference.py)


_WORDS = {Intent.LOOK: "a forward without gradients", Intent.FORWARD: "a training forward",
          Intent.STEP: "the optimizer step", Intent.SYNC: "a sync of a model sharded for inference"}


def exchange(mine: Intent, count: int, group, shm=None) -> list[tuple[Intent, int]]:
    """Every rank's next pass and how many passes it has started (a collective; through `shm` on one host)."""
    if shm is not None:
        return [(Intent(a), c) for a, c in shm.exchange(int(mine), count)]
    size = dist.get_world_size(group)
    out = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(out, torch.tensor([int(mine), count], dtype=torch.int64), group=group)
    # Host tensors on a gloo group of its own: read through numpy, no device to wait for (test_host_reads).
    return [(Intent(int(a)), int(c)) for a, c in (t.numpy() for t in out)]


def describe(everyone: list[tuple[Intent, int]], global_ranks: list[int]) -> str:
    """The error every rank raises when the passes cannot be reconciled (pure)."""
    said = "; ".join(f"rank {g} was at the end of a forward" + (f", asking for bucket {c} again" if c >= 0 else "")
                     if p is Intent.AGAIN else f"rank {g} started {_WORDS[p]} (its pass {c})"
                     for g, (p, c) in zip(global_ranks, everyone))
    return (f"stage 3: the ranks are in different passes: {said}. Every rank must run the same training "
            "forwards, backwards and steps (forwards without gradients may differ in number: generation, "
            "rollouts, evaluation); for uneven numbers of batches, give every rank the same number of "
            "training steps")
