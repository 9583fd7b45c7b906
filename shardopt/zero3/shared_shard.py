"""Stage 3 on one host: every rank's shard in shared memory, and a bucket's gather done by copying each
rank's chunk straight out of its shard (Note [Stage 3's gathers through shared memory]).

    shared = open_shared_shard(layout, dtype, group, want, why_not)   # a collective; None: the process group
    shard = shared.shard                       # this rank's shard, as torch.zeros(layout.shard_numel())
    copy = shared.start_gather(bucket, out)    # nothing read yet; copy.wait() copies, copy.drop() forgets
    shared.end_reads()                         # after every read phase (a pass, a whole-weights walk)
    shared.wait_readers()                      # before this rank writes its shard: no peer reads it
    shared.sync()                              # a barrier: the peers' writes before it are seen

Note [Stage 3's gathers through shared memory]
----------------------------------------------
Stage 3 gathers every bucket twice a step (forward and backward), where stage 2 gathers once after the
step. On one host gloo carries each gather over loopback TCP, copying every byte into the kernel and out
again on the cores that compute. On the 2-core VM the 30M-parameter GPT of `bench_step.py --peers` then
stepped at 1.27-1.30x our stage 2 (2 ranks; benchmarks/results/2026-11-28-stage3-host-cost-2.md): the
forward and backward's gathers. Stages 1-2 already gather through shared memory on one host (Note
[Gathering through shared memory] in parallel/shared_flat.py); stage 3 does the same with its shard: each
rank's shard is a file in /dev/shm that every rank maps (open_shared_flat, its handshake, its fallback to
the process group), and gathering bucket b copies chunk r of b from rank r's shard (the same offset on
every rank) into b's full storage, one memcpy per rank, on the thread that needs it. Nothing more is
held: the shards exist anyway (a rank's PSS is what it was; its RSS counts the pages of other ranks'
shards it read).

The copy is made when the gather is waited for, not when it starts: a bucket that the walk gathers only to
free it at once (a rank shadowing a peer's forward without gradients, a drained round's bucket no module
used) is never copied, as no peer waits for it: a gather is no longer a collective.

What a process group's gather gave for free is now the store's to keep: a rank must not read a peer's
chunk before the peer wrote it, nor write its own while a peer still reads it. Reads happen in read
phases: a pass (a forward, shadowed or not, and its end's exchanges; a backward round, walked or settled),
a whole-weights walk (full_params, streaming weights out), the refresh of the persistent buckets. Writes
happen outside them: the optimizer step, a load, full_params' write-back, construction. Two rules:
  - Every read phase ends with an arrival at the shard group's shared-memory barrier (`end_reads`), and
    every write waits first until every rank has arrived as often as this one (`wait_readers`, which the
    optimizer's `wait_params()` calls: the step and every load already call it before they write, as at
    stages 1-2). Every rank walks the same read phases (that is what the pass agreements keep, and what
    the process group's gathers needed), so the counts match, and a peer that has arrived as often as
    this rank has no read of this rank's old values left. Waiting needs nothing from this rank: a peer
    behind it is in a phase this rank finished, whose collectives it has joined.
  - Every read phase starts after the peers' writes: a pass after its agreement (every rank posts it after
    whatever it did before, the step's writes included), the other phases after a barrier (`sync`) of
    their own, all ranks entering them together as they did the gathers.
The barrier is the shared-memory one (x86, one pid namespace: Note [Barriers in shared memory] in
parallel/shm_barrier.py) with its dead-peer checks and timeout; where it cannot be used, stage 3 keeps the
process group's gathers. Frozen buckets (Note [Frozen parameters at stage 3] in store.py) have their chunks
in a shared region of their own per dtype, made when a ShardedDDP takes them, and gather the same way.
"""
from __future__ import annotations

import torch

from shardopt.parallel.shared_flat import open_shared_flat


class SharedShard:
    """Every rank's shard of stage 3's store, mapped; the gathers out of them and the barrier they need."""

    def __init__(self, shared, buckets):
        self.shard = shared.flat
        self.barrier = shared.barrier
        self.barrier.what = "the barrier of stage 3's parameter gathers through shared memory"
        # Per bucket: (rank r's shard, where chunk r starts there, where it goes in the full bucket, length).
        self.spans: dict[int, list] = {}
        self.add(shared, buckets)
        self.last_reads = None  # the arrival after this rank's last read phase

    def add(self, shared, buckets) -> list[torch.Tensor]:
        """`buckets` (of the store's layout) have their chunks, in order, in `shared` (a shared flat buffer of
        their chunk sizes: the shard, or a frozen region's); returns this rank's chunk of each."""
        chunks, at = [], 0
        for b in buckets:
            self.spans[b.index] = [(shared.buffers[r], at, b.chunk(r)[0] - b.start, b.chunk_numel)
                                   for r in range(b.world_size)]
            chunks.append(shared.flat[at:at + b.chunk_numel])
            at += b.chunk_numel
        return chunks

    def holds(self, b: int) -> bool:
        return b in self.spans

    def start_gather(self, b: int, out: torch.Tensor) -> "_Copy":
        return _Copy(self, b, out)

    def end_reads(self) -> None:
        """This rank has read nothing of its peers' shards since its last read phase began."""
        self.last_reads = self.barrier.arrive()

    def wait_readers(self) -> None:
        """Returns once no peer still reads this rank's shard in a phase this rank has finished."""
        if self.last_reads is not None:
            arrival, self.last_reads = self.last_reads, None
            arrival.wait()

    def sync(self) -> None:
        """A barrier: once it returns, every peer's writes before it are seen here (a collective)."""
        self.barrier.arrive().wait()
        self.last_reads = None


class _Copy:
    """A bucket's gather through shared memory, as a collective's Work: wait() copies (once)."""

    __slots__ = ("shared", "b", "out")

    def __init__(self, shared: SharedShard, b: int, out: torch.Tensor):
        self.shared, self.b, self.out = shared, b, out

    def wait(self) -> None:
        if self.out is None:
            return
        out = self.out
        for buffer, src, dst, n in self.shared.spans[self.b]:
            out[dst:dst + n].copy_(buffer[src:src + n])
        self.out = None

    def drop(self) -> None:
        """The bucket is freed unused: nothing to copy."""
        self.out = None


def open_shared_shard(layout, dtype: torch.dtype, group, want: bool | None, why_not: str | None
                      ) -> SharedShard | None:
    """A collective over `group`: every rank's shard in shared memory, or None (the process group gathers)."""
    shared = open_shared_flat(layout.shard_numel(), dtype, group, want, why_not)
    if shared is None:
        return None
    if shared.barrier is None:
        if want:
            raise RuntimeError("shared_memory_gather=True at stage 3 needs the shared-memory barrier (x86, one pid "
                               "namespace: Note [Barriers in shared memory]); pass None to use the process group")
        return None
    return SharedShard(shared, layout.buckets)


def open_frozen_region(shared: SharedShard, buckets, dtype: torch.dtype, group) -> list[torch.Tensor] | None:
    """A collective over `group`: frozen `buckets`' chunks in shared memory beside the shard (Note [Frozen
    parameters at stage 3] in store.py), gathered as the shard's are; returns this rank's chunk of each, or None
    (the process group gathers them: /dev/shm could not hold them)."""
    region = open_shared_flat(sum(b.chunk_numel for b in buckets), dtype, group, None, None)
    return shared.add(region, buckets) if region is not None else None
