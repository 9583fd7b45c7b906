"""Stage 3's buckets: each one's full storage and state, and the gathers and frees that move it between them.

    buckets = Buckets(layout, rank, members, gather, dtype, device, phase)
    buckets.start_gather(b); buckets.finish_gather(b)    # FREE -> GATHERING -> LIVE
    buckets.reshard(b)                                    # -> FREE
    buckets.chunk(b)                                      # this rank's chunk of bucket b

Between uses each rank holds only its chunk of every bucket (`every_chunk`, in the model's dtype). A
bucket's full parameters live in storage of their own (`full[b]`; Note [Stage-3 buckets hold whole
parameters] in layout.py) that exists only while the bucket is gathered. Where a storage tier plugs in: a
chunk reaches its gather as `chunk(b)` handed to the gatherer (parallel/gathers.py), and is written back
through `every_chunk[b]` (a step, a load, take_chunks).

Note [Parameters between gathers]
---------------------------------
A gathered parameter is a view of its bucket's storage. When the bucket is freed, the parameter's `.data`
becomes an empty tensor of its dtype (as DeepSpeed's stage 3 does), so code that reads a weight outside a
forward gets an obvious shape error instead of freed memory; `opt.full_params()` gathers everything for
such code. A free resizes the bucket's storage to nothing and a gather back, keeping the storage object
the views point at, so a view stays valid across a free and a gather: autograd's saved weights are packed
as (bucket, the view) and unpacked by asking for the bucket again (`pack`; the store's `unpack`). Gathers
write through a second tensor on the same storage (`_comm`), so autograd's version counter of the
parameters' views is not bumped by the collective that refills them.

Note [Gradients of parameters not gathered]
-------------------------------------------
Some weights are never read in backward: an embedding's, a first Linear's on an input without grad. Its
bucket may be free when its gradient arrives, and AccumulateGrad would check the gradient against the
empty placeholder's shape and fail. So nothing is ever accumulated into a stage-3 parameter: its C++ hook
takes the gradient before AccumulateGrad runs and hands it to the bucket engine (Note [Stage 3's gradient
hooks in C++] in csrc/comm/grad_hooks.h).

Note [One rank holds the whole bucket]
--------------------------------------
With one rank in the shard group a bucket's chunk is the whole bucket, so its full storage *is* its chunk
(`aliased`): a gather issues no collective and copies nothing, a free only gives the parameters their empty
placeholder back, and nothing is added to `live`. The walk, the states, the gather count and the hooks are
as with several ranks. What differs: the optimizer's buckets all lie in one storage (the shard), so a
saved view is told its bucket by offset (`bucket_at`); full_params(writeback=False) puts the chunks back on
exit; a write into a parameter inside a forward reaches the chunk (as with DDP), where with several ranks
it is lost when the bucket is freed.
"""
from __future__ import annotations

import bisect
import contextlib
import enum
import operator
import time

import torch

from shardopt.parallel.gathers import DONE, Route

_STORAGE_CDATA = operator.attrgetter("_cdata")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


class BucketState(str, enum.Enum):
    """Where a bucket's full parameters are: FREE (no storage) -start_gather-> GATHERING (storage, a gather
    writing it) -finish_gather-> LIVE (its parameters are views of it) -reshard-> FREE."""
    FREE = "free"
    GATHERING = "gathering"
    LIVE = "live"


FREE, GATHERING, LIVE = BucketState.FREE, BucketState.GATHERING, BucketState.LIVE


class Buckets:
    """This rank's chunks and the full storage of every bucket of `layout` (trainable, then frozen)."""

    def __init__(self, layout, rank: int, members: list, gather, dtype: torch.dtype, device, phase: dict,
                 tier=None):
        self.layout, self.rank, self.members, self.gather = layout, rank, members, gather
        self.tier = tier  # offload_param="nvme": chunks on disk (Note [The parameter shard on disk] in tiers/)
        self.dtype, self.device, self.phase = dtype, device, phase
        self.aliased = gather.route is Route.ONE_RANK  # Note [One rank holds the whole bucket]
        self.trainable = len(layout.buckets)  # buckets from here on hold frozen parameters
        self.every_chunk = list(gather.chunks)
        self.frozen_shard_bytes = 0
        self._empty: dict = {}  # dtype -> the one empty tensor freed parameters of that dtype hold
        self.placeholder = self.empty_of(dtype)
        self._empty_storage = self.placeholder.untyped_storage()._cdata
        self._shard_storage = gather.shard.untyped_storage()._cdata
        offsets = layout.chunk_offsets()
        self._chunk_starts = [offsets[b.index] for b in layout.buckets]
        self.views: list = []
        self.full: list = []
        self.state: list[BucketState] = []
        self._lo, self._comm = [], []
        # Note [Stage-3 buckets mapped, not copied] in parallel/shared_memory.py: bucket -> its mapping, made at
        # the first pass (`install_maps`); `_mapped[b]`: the private storage a bucket shown through its mapping
        # had (full_params' copies use it again).
        self.maps: dict[int, torch.Tensor] = {}
        self._mapped: dict[int, tuple] = {}
        self._to_map: set[int] = set(gather.mappable())
        self.bucket_params: list[list[int]] = []
        self.buckets_of_param: list[list[int]] = []  # whole parameters: one bucket each
        self._bucket_of_storage: dict = {}
        self.handles: dict[int, object] = {}
        self.num_gathers = 0
        self.live = 0  # bytes of full storage held now
        self.peak_live = 0  # the most `live` has been since construction (or reset_peak())
        self._in_place_seen: list = []  # Note [Parameters in place, checked in C]
        self.add(layout.buckets, dtype)

    def empty_of(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._empty:
            self._empty[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return self._empty[dtype]

    def chunk(self, b: int) -> torch.Tensor:
        """This rank's chunk of bucket b, as its gather reads it."""
        return self.every_chunk[b]

    @contextlib.contextmanager
    def holding(self, b: int, read: bool = True, write: bool = False):
        """Bucket b's chunk in memory inside the block (with the parameter tier: read first unless read=False,
        written back after if write)."""
        if self.tier is None:
            yield self.every_chunk[b]
            return
        chunk = self.tier.hold(b, read)
        try:
            yield chunk
        finally:
            self.tier.release(b, write)

    @torch.no_grad()
    def write_chunk(self, b: int, values: torch.Tensor) -> None:
        with self.holding(b, read=False, write=True) as chunk:
            chunk.copy_(values)

    def read_ahead(self, buckets) -> None:
        """The parameter tier starts reading these buckets' chunks (the schedule's next gathers)."""
        if self.tier is not None:
            self.tier.read_ahead(buckets)

    def add(self, buckets, dtype: torch.dtype) -> None:
        """Storage for `buckets` (of self.layout), of `dtype`: each parameter a view of its bucket's full
        storage, made while that storage exists; then the storage goes, so that not even construction holds
        the whole model."""
        for slot in self.layout.params[len(self.views):]:
            self.views.append(torch.empty(slot.shape, dtype=dtype, device=self.device) if not slot.numel else None)
            self.buckets_of_param.append([])
        for b in buckets:
            self._lo.append(b.chunk(self.rank)[0] - b.start)
            if self.aliased:
                assert b.chunk_numel == b.numel and self._lo[-1] == 0
                full = self.every_chunk[b.index]
            else:
                full = torch.empty(b.numel, dtype=dtype, device=self.device)
            self.full.append(None)
            self._comm.append(torch.empty(0, dtype=dtype, device=self.device).set_(
                full.untyped_storage(), full.storage_offset(), (b.numel,)))
            self.bucket_params.append([])
            for i in b.params:
                self.bucket_params[b.index].append(i)
                self.buckets_of_param[i].append(b.index)
            self._point(b.index, full, self._comm[-1])
            if not self.aliased:
                full.untyped_storage().resize_(0)
            self.state.append(FREE)

    def _point(self, b: int, full: torch.Tensor, comm: torch.Tensor, views: list | None = None) -> None:
        """Bucket b's full storage is `full` (gathers write it through `comm`): its parameters' views are cut from
        it (while it has memory; or given), and a tensor in it is known as bucket b's (`bucket_at`)."""
        if self.full[b] is not None:
            del self._bucket_of_storage[self.full[b].untyped_storage()._cdata]
        self.full[b], self._comm[b] = full, comm
        bucket = self.layout.buckets[b]
        for k, i in enumerate(self.bucket_params[b]):
            slot = self.layout.params[i]
            s = slot.offset - bucket.start
            self.views[i] = full[s:s + slot.numel].view(slot.shape) if views is None else views[k]
        self._bucket_of_storage[full.untyped_storage()._cdata] = b
        self._in_place_seen = []

    def add_mappable(self, buckets) -> None:
        """These buckets take their mappings at the next pass."""
        self._to_map |= set(buckets) - set(self.maps)

    def install_maps(self) -> None:
        """Mappable buckets that are free take their mappings: from the first pass on, their gathers copy
        nothing (Note [Stage-3 buckets mapped, not copied])."""
        for b in sorted(self._to_map):
            if self.state[b] != FREE:
                continue
            self._to_map.discard(b)
            full = self.maps.get(b)
            if full is None:
                full = self.gather.mapping(b)
                if full is None:
                    continue  # the kernel would not: copied, as smaller buckets are
                self.maps[b] = full
            self._mapped[b] = (self.full[b], self._comm[b], [self.views[i] for i in self.bucket_params[b]])
            self._point(b, full, full)

    def mapped(self) -> list[int]:
        """Buckets shown through their mappings now."""
        return list(self._mapped)

    def unmap(self, b: int) -> None:
        """Bucket b (free) has its private storage again, until `install_maps` (full_params writes into it)."""
        self._point(b, *self._mapped.pop(b))
        self._to_map.add(b)

    # ------------------------------------------------------------ life cycle
    def allocate(self, b: int, views: bool = True) -> None:
        """Bucket b's full storage exists again (its contents undefined); with `views`, its parameters are
        its views (a gather sets them when it is waited for, so nothing reads a bucket half written)."""
        full = self.full[b]
        if not self.aliased and b not in self._mapped:
            nbytes = full.numel() * full.element_size()
            full.untyped_storage().resize_(nbytes)
            self.live += nbytes
            self.peak_live = max(self.peak_live, self.live)
        self.state[b] = LIVE
        if views:
            self.show(b)

    def show(self, b: int) -> None:
        for i in self.bucket_params[b]:
            self.members[i].data = self.views[i]

    def start_gather(self, b: int, exact: bool = False) -> None:
        """Starts gathering bucket b into freshly allocated storage; exact: never rounded across nodes (whole
        weights: Note [Stage 3's parameters across nodes, rounded] in parallel/mesh_plan.py)."""
        self.allocate(b, views=False)
        self.handles[b] = self.launch(b, exact=exact)
        self.state[b] = GATHERING
        self.num_gathers += 1

    def launch(self, b: int, out: torch.Tensor | None = None, exact: bool = False):
        """Starts every rank's chunk of bucket b into its full storage (or into `out`); returns what to wait on."""
        if self.aliased or b in self._mapped:
            return DONE
        chunk = self.tier.hold(b) if self.tier is not None else self.chunk(b)  # released once it has arrived
        return self.gather.start(b, chunk, self._comm[b] if out is None else out, exact)

    def _arrived(self, b: int) -> None:
        """Bucket b's gather has read this rank's chunk."""
        if self.tier is not None:
            self.tier.release(b)

    def through_shared_memory(self, b: int) -> bool:
        """Whether bucket b is gathered out of the shards in shared memory (not a collective)."""
        return self.gather.through_shared_memory(b)

    def finish_gather(self, b: int) -> None:
        t0 = time.perf_counter()
        self.handles.pop(b).wait()
        self._arrived(b)
        self.phase["gather"] += time.perf_counter() - t0
        self.state[b] = LIVE
        self.show(b)

    def reshard(self, b: int, even_persistent: bool = False) -> None:
        kept = self.layout.buckets[b].persistent and not even_persistent
        if self.state[b] == GATHERING:
            if kept or not self.through_shared_memory(b):
                self.finish_gather(b)  # never free memory a collective is still writing
            else:
                self.handles.pop(b).drop()  # nothing was copied yet, and no peer waits for this rank
                self._arrived(b)
        if self.state[b] == FREE or kept:
            return
        empty = self.empty_of(self.full[b].dtype)
        for i in self.bucket_params[b]:
            self.members[i].data = empty
        if not self.aliased and b not in self._mapped:
            self.full[b].untyped_storage().resize_(0)
            self.live -= self.full[b].numel() * self.full[b].element_size()
        self.state[b] = FREE

    def gather_persistent(self, keep: list[int]) -> None:
        """The persistent buckets `keep` take every rank's current chunk."""
        for b in keep:
            self.handles[b] = self.launch(b, exact=True)  # read between passes too: the shard's values
            self.state[b] = GATHERING
            self.num_gathers += 1
        for b in keep:
            self.finish_gather(b)

    def gather_into_scratch(self, b: int) -> None:
        """Bucket b's collective, for peers that asked for it, into scratch memory: here it is live, and its
        modules may be reading it."""
        scratch = torch.empty(self.layout.buckets[b].numel, dtype=self.full[b].dtype, device=self.device)
        self.launch(b, scratch).wait()
        self._arrived(b)
        self.num_gathers += 1

    @torch.no_grad()
    def take_chunks(self) -> None:
        """This rank's chunk of every gathered bucket from the full parameters (after they were written)."""
        for b in self.layout.buckets:
            if self.state[b.index] == LIVE and not self.aliased:  # aliased: written in place already
                lo = self._lo[b.index]
                self.write_chunk(b.index, self.full[b.index][lo:lo + b.chunk_numel])

    def own_part(self, b: int) -> torch.Tensor:
        """This rank's part of bucket b's full storage (while it has memory)."""
        lo = self._lo[b]
        return self.full[b][lo:lo + self.layout.buckets[b].chunk_numel]

    # Read phases (Note [Gathering through shared memory] in parallel/shared_memory.py).
    def end_reads(self) -> None:
        self.gather.end_reads()

    def sync(self) -> None:
        self.gather.sync()

    def wait_readers(self) -> None:
        self.gather.wait_readers()

    # --------------------------------------------------------------- questions
    def live_bytes(self) -> int:
        """Bytes of full parameters gathered now (persistent buckets included), in memory of this rank's own."""
        return self.live

    def mapped_bytes(self) -> int:
        """Bytes of the buckets gathered as mappings of every rank's shard: no memory of their own."""
        return sum(self.full[b].numel() * self.full[b].element_size() for b in self._mapped)

    def reset_peak(self) -> None:
        self.peak_live = self.live

    def bucket_at(self, t: torch.Tensor) -> int | None:
        """The bucket whose full storage `t` lies in, or None. One rank alone: the optimizer's buckets all lie
        in the shard's storage, told apart by offset (Note [One rank holds the whole bucket])."""
        cdata = t.untyped_storage()._cdata
        if cdata == self._shard_storage and self.aliased:
            return bisect.bisect_right(self._chunk_starts, t.storage_offset()) - 1
        return self._bucket_of_storage.get(cdata)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in a bucket's full storage (memory that a free gives back)."""
        return t.untyped_storage()._cdata in self._bucket_of_storage

    def pack(self, t: torch.Tensor):
        """Autograd saves `t` for backward: a view of a bucket is kept as where it lies, not as memory."""
        try:
            b = self.bucket_at(t)
        except (RuntimeError, NotImplementedError):
            return t
        if b is None or self.layout.buckets[b].persistent:
            return t
        return (b, t)  # Note [Parameters between gathers]: valid again once bucket b is gathered

    # Note [Parameters in place, checked in C]
    # ----------------------------------------
    # check_params_in_place runs before every forward and every step (Note [Parameters stay in the flat
    # buffer] in optimizer.py). Whether a parameter is in place depends only on what it points at: its
    # storage object (whose `_cdata` stays the same while a bucket is freed and gathered again, as resize_
    # keeps the object), its offset and shape in it, and its dtype. So all_in_place reads those four for
    # every parameter with C loops (map over the tensors) and compares them with the last few sets that
    # in_place accepted one by one: no Python call per parameter when nothing moved.
    def all_in_place(self, params: list) -> bool:
        key = (list(map(_STORAGE_CDATA, map(torch.Tensor.untyped_storage, params))),
               list(map(torch.Tensor.storage_offset, params)), list(map(_SHAPE, params)), list(map(_DTYPE, params)))
        if key in self._in_place_seen:
            return True
        if not all(self.in_place(p, i) for i, p in enumerate(params)):
            return False
        self._in_place_seen = [key] + self._in_place_seen[:3]
        return True

    def in_place(self, p: torch.Tensor, index: int) -> bool:
        """Whether parameter `p` (member `index`) still holds what this store put there: its bucket view, or the
        empty tensor while freed."""
        view = self.views[index]
        if p.dtype != self.dtype:
            return False
        if p.numel() == 0 and view.numel():  # freed: the shared empty tensor, not an empty one of its own
            return p.untyped_storage()._cdata == self._empty_storage
        return p.data_ptr() == view.data_ptr() and p.shape == view.shape
