"""Which pass every rank starts next, agreed before its gathers (stage 3).

Note [Passes every rank agrees on]
----------------------------------
Every stage-3 pass walks the whole schedule (Note [Stage-3 schedule] in schedule.py), so ranks stay in
step as long as they run the same passes: the same training forwards, backwards and steps. Forwards
without gradients are different: generation, rollouts and evaluation run as many of them as each rank's
data asks, and a rank that ran more of them than another paired its gathers with the other's next pass
(gloo aborted on a size mismatch, or the group timed out a minute later). So before each pass, each rank
says which pass it starts (`Intent`), in one small all-gather on a group of its own:
  - all the same: go on;
  - some start a forward without gradients (LOOK) and others something else: those others walk a LOOK
    pass's gathers without computing anything (each bucket gathered and freed at once: the store's
    `shadow_look`), and ask again; so a rank that is done with its rollouts keeps serving the others'
    gathers until every rank starts the same pass, with no padding by the user and no `synced_gpus`;
  - different otherwise (a training forward on one rank, the step on another): no rank can stand in for
    that, so every rank raises at once, naming what each one started (`describe`).
Backwards are not agreed on: a rank whose backward reaches none of the store's buckets (it skipped it, or
its loss used none of them) walks that backward round in the step's `settle`, and a backward runs
collectives (its reduce-scatters, the end-of-backward all-reduce) that such a rank joins only from its
step; an agreement inside backward would wait for it there. So the step's agreement comes after this rank
has joined every reduction of its peers' backwards (GradSync.finish's `at_step`) and before the step's own
flags all-reduce, where a peer still running forwards without gradients (generation between backward and
step) can be shadowed. The forward before and the step after are agreed on, which keeps the rounds in
order. (Each forward also ends with one exchange on the same group, Note [A module called again] in store.py:
a rank whose forward needed a bucket again after freeing it asks its peers for that gather there; `AGAIN`.)
The cost is one all-gather of two integers per forward and per step (a second per forward, its end's, with
reshard_after_forward=True), on a gloo group of host
tensors (no device synchronisation), or, where the ranks share a host, through shared memory (Note
[Agreements in shared memory] in parallel/shm_exchange.py: on gloo each cost about 2 ms on the 2-core VM). A LOOK pass right after a training forward, before its backward,
shadows correctly only if the shadowing rank holds the same buckets gathered (the seam): run such
evaluation after the backward.
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
    """Every rank's next pass and how many passes it has started (a collective on `group`; through `shm`,
    the group's ShmExchange, where its ranks share a host: Note [Agreements in shared memory] in
    parallel/shm_exchange.py)."""
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
