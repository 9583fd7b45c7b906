"""Stage 3 on one host: every rank's shard in shared memory, and a bucket's gather done by copying each
rank's chunk straight out of its shard (Note [Stage 3's gathers through shared memory]).

    shared = open_shared_shard(layout, dtype, group, want, why_not)   # a collective; None: the process group
    shared.chunks                              # this rank's chunk of every bucket, zeros (page-aligned when mappable)
    copy = shared.start_gather(bucket, out)    # nothing read yet; copy.wait() copies, copy.drop() forgets
    full = shared.mapping(bucket)              # or: the whole bucket as every rank's chunks mapped end to end
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

Note [Stage-3 buckets mapped, not copied]
-----------------------------------------
Copying out of the shards still moved every byte of the model twice a step on the cores that compute, each
rank's own chunk included: on the 30M GPT of `bench_step.py --peers` stage 3 stayed 1.05-1.21x our stage 2
(benchmarks/results/2026-11-29-stage3-shared-gather.md). A bucket's full storage is its W chunks end to end,
and the chunks already lie in shared memory: if each chunk is whole pages, those pages can be mapped a second
time, end to end, at an address of their own (Note [Mapping a shared mapping again] in parallel/page_map.py),
and that mapping *is* the bucket gathered: the gather copies nothing and holds no memory, like the one-rank
case (Note [One rank holds the whole bucket] in store.py). So on one host:
  - The plan pads a non-persistent bucket whose chunk is at least MAP_MIN_PAGES pages (64 KiB in fp32) until
    every chunk is whole pages (`page_numel` in layout.plan_layout; at most a page per chunk, under 1/16 of
    it), and the shard places such chunks on page boundaries (layout.place_chunks). Smaller buckets (the tests' tiny
    models among them) are laid out and copied as before.
  - The store points such a bucket's parameters at its mapping, from the first pass on (construction and
    materialize write the full buckets, so they keep private storage), and a gather of it, a free, the seam,
    a gather asked again, are bookkeeping only: the walk, its states, agreements and gather count are the
    same code. The reads are no longer at the gather's wait but wherever the modules compute; they all lie
    inside the pass whose end is the arrival above, so the two rules hold as they are.
  - Whatever writes full parameters works on private copies: full_params() (with or without write-back)
    copies the buckets out of the shards as before and points the parameters back at the mappings on exit.
    A write into a parameter inside a pass is the one difference: here it reaches the shards (every rank
    writing it), where a copied bucket loses it at its free; both differ from DDP (write through
    full_params() between steps, as at stage 3 anywhere).
Persistent buckets stay private copies refreshed after the step: they are read between passes too, where a
peer may be writing its chunk.
"""
from __future__ import annotations

import torch

from shardopt.layout import mappable, page_numel, place_chunks
from shardopt.parallel.page_map import map_spans
from shardopt.parallel.shared_flat import open_shared_flat


class SharedShard:
    """Every rank's shard of stage 3's store, mapped; the gathers out of them and the barrier they need."""

    def __init__(self, shared, buckets, offsets: list[int]):
        self.shard = shared.flat
        self.barrier = shared.barrier
        self.barrier.what = "the barrier of stage 3's parameter gathers through shared memory"
        # Per bucket: (rank r's shard, where chunk r starts there, where it goes in the full bucket, length).
        self.spans: dict[int, list] = {}
        self.mappable: set[int] = set()  # buckets whose chunks are whole pages on page boundaries
        self.chunks = self.add(shared, buckets, offsets)
        self.last_reads = None  # the arrival after this rank's last read phase

    def add(self, shared, buckets, offsets: list[int]) -> list[torch.Tensor]:
        """`buckets` (of the store's layout) have their chunks at `offsets` (layout.place_chunks) in `shared` (a
        shared flat buffer: the shard, or a frozen region's); returns this rank's chunk of each."""
        chunks = []
        for b, at in zip(buckets, offsets):
            self.spans[b.index] = [(shared.buffers[r], at, b.chunk(r)[0] - b.start, b.chunk_numel)
                                   for r in range(b.world_size)]
            if mappable(b, page_numel(shared.flat.dtype.itemsize)):
                self.mappable.add(b.index)
            chunks.append(shared.flat[at:at + b.chunk_numel])
        return chunks

    def mapping(self, b: int) -> torch.Tensor | None:
        """Bucket b whole: every rank's chunk mapped end to end, no copy (Note [Stage-3 buckets mapped, not
        copied]); None if it cannot be."""
        if b not in self.mappable:
            return None
        spans = sorted(self.spans[b], key=lambda s: s[2])  # in the bucket's order
        return map_spans([(buffer, src, n) for buffer, src, _, n in spans])

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
    offsets, numel = place_chunks(layout.buckets, page_numel(dtype.itemsize))
    shared = open_shared_flat(numel, dtype, group, want, why_not)
    if shared is None:
        return None
    if shared.barrier is None:
        if want:
            raise RuntimeError("shared_memory_gather=True at stage 3 needs the shared-memory barrier (x86, one pid "
                               "namespace: Note [Barriers in shared memory]); pass None to use the process group")
        return None
    return SharedShard(shared, layout.buckets, offsets)


def open_frozen_region(shared: SharedShard, buckets, dtype: torch.dtype, group) -> list[torch.Tensor] | None:
    """A collective over `group`: frozen `buckets`' chunks in shared memory beside the shard (Note [Frozen
    parameters at stage 3] in store.py), gathered as the shard's are; returns this rank's chunk of each, or None
    (the process group gathers them: /dev/shm could not hold them)."""
    offsets, numel = place_chunks(buckets, page_numel(dtype.itemsize))
    region = open_shared_flat(numel, dtype, group, None, None)
    return shared.add(region, buckets, offsets) if region is not None else None
