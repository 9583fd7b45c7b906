"""Every rank's two small integers, exchanged through memory the ranks of one host share (Note [Agreements
in shared memory]).

    ex = open_shm_exchange(group)       # a collective; None where the ranks cannot share memory
    everyone = ex.exchange(a, b)        # [(a, b) of rank 0, of rank 1, ...], as an all-gather would give

Note [Agreements in shared memory]
----------------------------------
Stage 3's ranks agree before each pass on which pass they start, and each forward ends with an exchange
where a rank asks for buckets it needs again (Note [Passes every rank agrees on] in zero3/passes.py, Note
[A module called again] in zero3/store.py): two or three all-gathers of two integers per training step. On
gloo each is a round of loopback TCP messages, and a waiting rank sleeps in the kernel until its message
comes; on the project VM (2 cores, 2 ranks, a step of tiny modules) that was about 2 ms per exchange
(benchmarks/results/2026-11-28-stage3-host-cost-2.md), the same cost the shared-memory barrier removed from
the gather after a step (Note [Barriers in shared memory] in shm_barrier.py). So on one host the exchange is
that barrier with a payload: each rank writes its two integers into its own slot, then arrives; once every
rank has arrived, every slot of that epoch is read. The slots alternate by the epoch's parity: a rank may
write the next exchange's slot while a slower one still reads this one's, but not the one after (writing
that needs the slower rank's arrival at the next epoch, which comes after its reads). The barrier's
ordering argument (x86 only), its dead-peer checks and its timeout hold as they are; where it cannot be
used (another machine, pid namespaces, ranks on several hosts) the exchange stays on gloo. The emulated
cluster (shardopt/cluster: network namespaces on one VM) shares /dev/shm, so there the agreements take this
path and not the emulated links; the data paths still cross them.
"""
from __future__ import annotations

import torch

from shardopt.parallel.shared_flat import open_shared_flat

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
    """A collective over `group`: the exchange through shared memory, or None (the ranks are not on one host,
    or cannot use the shared-memory barrier: Note [Barriers in shared memory])."""
    shared = open_shared_flat(_SLOTS, torch.int64, group, None, None)
    if shared is None or shared.barrier is None:
        return None
    return ShmExchange(shared)
