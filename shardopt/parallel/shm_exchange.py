"""Every rank's two small integers, exchanged through memory the ranks of one host share.

    ex = open_shm_exchange(group)       # a collective; None where the ranks cannot share memory
    everyone = ex.exchange(a, b)        # [(a, b) of rank 0, of rank 1, ...], as an all-gather would give

Note [Agreements in shared memory]
----------------------------------
Stage 3's agreements (zero3/passes.py) are small all-gathers, each a round of loopback TCP on gloo. On one
host they are the shared-memory barrier (Note [Barriers in shared memory] in shm_barrier.py) with a payload;
slots alternate by the epoch's parity, so a rank may write the next slot while a slower one reads this one.
"""
from __future__ import annotations

import torch

from shardopt.parallel.shared_memory import open_shared_flat

_SLOTS = 4  # two epochs' parities x two integers


class ShmExchange:
    def __init__(self, shared):
        self.shared = shared
        self.barrier = shared.barrier
        self.barrier.what = "an agreement of stage 3's passes through shared memory"
        self.slots = [b.numpy() for b in shared.buffers]  # plain memory: no torch operation per read
        self.mine = self.slots[shared.barrier.rank]

    def exchange(self, a: int, b: int) -> list[tuple[int, int]]:
        at = 2 * ((self.barrier.epoch + 1) % 2)
        self.mine[at] = a
        self.mine[at + 1] = b
        self.barrier.arrive().wait()
        return [(int(s[at]), int(s[at + 1])) for s in self.slots]


def open_shm_exchange(group) -> ShmExchange | None:
    """A collective over `group`: the exchange through shared memory, or None where the barrier cannot be used."""
    shared = open_shared_flat(_SLOTS, torch.int64, group, None, None)
    if shared is None or shared.barrier is None:
        return None
    return ShmExchange(shared)
