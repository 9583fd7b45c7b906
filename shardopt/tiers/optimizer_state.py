"""The optimizer-state tier: this rank's master chunks and the inner optimizer's state in a scratch file.

    tier = StateTier(layout, rank, pieces, piece_params, master_chunks, kinds, dtype, config)
    for b in tier.walk(read=ALL, write=ALL):   # bucket b's master and state are in memory meanwhile
        ...

Note [The optimizer's state on disk]
------------------------------------
With offload="nvme" a bucket's record in the file holds, one after the other, this rank's master chunk of
it and a chunk per kind of elementwise state the inner optimizer keeps (Adam's exp_avg and exp_avg_sq,
SGD's momentum_buffer, ...: `probe_state` asks the optimizer), each part padded to 4 KiB, so each bucket is
one contiguous range of the file, read and written in large requests through a ring of buffers (Note [The
ring's walk] in ring.py). The tensors the rest of shardopt knows stay the same objects: the inner
optimizer's parameters (one per piece), its state tensors (keyed by those) and the master chunks. While a
bucket is walked they are pointed at its record in a ring buffer (Tensor.set_); otherwise they are empty.
State an optimizer creates during a step (its first), or a load installs, is copied into the record before
it is written. Per-parameter scalars (Adam's step) stay in memory. An optimizer that fills its state when it
is built (Adagrad's sum) has its fill written into every record at construction.
"""
from __future__ import annotations

import enum
import itertools

import torch

from shardopt.layout import Layout
from shardopt.tiers.disk import ScratchFile, TierError, aligned_empty, round_up
from shardopt.tiers.ring import Ring, walked


class Parts(str, enum.Enum):
    """What of a bucket's record a walk reads or writes."""
    NONE = "none"
    MASTER = "master"
    ALL = "all"


NONE, MASTER, ALL = Parts.NONE, Parts.MASTER, Parts.ALL


def probe_state(optim, optim_kwargs: dict, groups: list[dict], dtype: torch.dtype) -> tuple[tuple, list]:
    """(the elementwise state kinds the inner optimizer keeps, per group {kind: fill} of state it makes when
    built): one step of a two-element parameter per group's hyper-parameters."""
    kinds, fills = [], []
    for hyper in groups:
        p = torch.zeros(2, dtype=dtype)
        o = optim([dict(hyper, params=[p])], **optim_kwargs)
        eager = {}
        for k, v in o.state.get(p, {}).items():
            if torch.is_tensor(v) and v.shape == p.shape:
                if not bool((v == v[0]).all()):
                    raise NotImplementedError(f"offload='nvme': {optim.__name__} builds its state {k!r} with "
                                              "values that differ by element; use offload='cpu'")
                eager[k] = float(v[0])
        fills.append(eager)
        p.grad = torch.ones_like(p)
        o.step()
        for k, v in o.state[p].items():
            if torch.is_tensor(v) and v.shape == p.shape and k not in kinds:
                if v.dtype != dtype:
                    raise NotImplementedError(f"offload='nvme': {optim.__name__} keeps its state {k!r} in {v.dtype}, "
                                              f"not in the master dtype {dtype}; use offload='cpu'")
                kinds.append(k)
    return tuple(kinds), fills


class StateTier:
    """Master chunks and inner-optimizer state, bucket by bucket in a scratch file (Note above)."""

    def __init__(self, layout: Layout, rank: int, pieces, piece_params: list, master_chunks: list, kinds: tuple,
                 dtype: torch.dtype, config, fills: list):
        self.layout, self.kinds, self.dtype = layout, kinds, dtype
        self.piece_params, self.master_chunks = piece_params, master_chunks
        self.inner = None  # the inner optimizer, once built (attach)
        numels = [b.chunk_numel for b in layout.buckets]
        self.part_bytes = [round_up(n * dtype.itemsize) for n in numels]
        parts = 1 + len(kinds)
        self.record_bytes = [parts * n for n in self.part_bytes]
        self.offsets = list(itertools.accumulate([0] + self.record_bytes[:-1])) if numels else []
        self.config = config
        self.file = ScratchFile(config.nvme_path, "optimizer", sum(self.record_bytes), config.aio)
        self.ring = Ring(max(self.record_bytes, default=0), config.offload_buffer_count)
        # Per bucket: (piece index, where it starts in the chunk, its elements) of this rank's pieces in it.
        self.pieces_of: list[list[tuple[int, int, int]]] = [[] for _ in numels]
        for i, pc in enumerate(pieces):
            inside = pc.start - layout.buckets[pc.bucket].chunk(rank)[0]
            self.pieces_of[pc.bucket].append((i, inside, pc.numel))
        self._fills = [fills[b.group] for b in layout.buckets]
        self._empty = torch.empty(0, dtype=dtype)
        self._holder: dict[int, int] = {}  # bucket -> the walk its tensors point into now
        self._walks = 0
        self.pending = None  # a step left open (tiers/pending_step.py), finished before any other walk

    def attach(self, inner) -> None:
        self.inner = inner

    # ------------------------------------------------------------ walking
    def walk(self, buckets=None, read: Parts = ALL, write: Parts = ALL):
        """Yields each bucket in turn with its master chunk, pieces and (read=ALL) state pointed at its record;
        write: what of the record goes back to the file after."""
        return walked(lambda: self.start_walk(buckets, read, write))

    def start_walk(self, buckets=None, read: Parts = ALL, write: Parts = ALL) -> "StateWalk":
        """The walk of `walk`, a bucket at a time: next() points the next bucket's tensors at its record, done()
        writes it behind, close() waits. A step left open (pending) is finished first."""
        if write == ALL and read != ALL:
            raise ValueError("a walk that writes the whole record reads it first")
        self.settle()
        for b in list(self._holder):  # an abandoned walk's (its user raised): never read from a reused buffer
            self._unpoint(b)
        self._holder.clear()
        self._walks += 1
        order = list(range(len(self.layout.buckets)) if buckets is None else buckets)
        return StateWalk(self, self._walks, order, read, write)

    def settle(self) -> None:
        """The step left open by the last step() (Note [The step walked in the next forward]) finished."""
        if self.pending is not None:
            self.pending.finish()

    def initialize(self, load_master) -> None:
        """Every record written: the master chunk by load_master(b, it), the state the optimizer built filled."""
        for b, slot in self.ring.walk(self.file, range(len(self.layout.buckets)),
                                      lambda b: (self.offsets[b], 0, self.record_bytes[b])):
            load_master(b, self.part(slot, b, 0))
            for k, kind in enumerate(self.kinds, 1):
                self.part(slot, b, k).fill_(self._fills[b].get(kind, 0.0))

    def adopt(self) -> None:
        """State installed in memory (a load of a state dict) into the records, and out of memory."""
        for _ in self.walk(read=ALL, write=ALL):
            pass

    def _span(self, b: int, read: Parts, write: Parts) -> tuple[int, int, int]:
        size = {NONE: 0, MASTER: self.part_bytes[b], ALL: self.record_bytes[b]}
        return self.offsets[b], size[read], size[write]

    def part(self, slot: torch.Tensor, b: int, k: int) -> torch.Tensor:
        """Part k (0: the master chunk, then the kinds) of bucket b's record in `slot`."""
        at = k * self.part_bytes[b]
        return slot[at:at + self.part_bytes[b]].view(self.dtype)[:self.layout.buckets[b].chunk_numel]

    def _point(self, b: int, slot: torch.Tensor, state: bool) -> None:
        storage, per_part = slot.untyped_storage(), self.part_bytes[b] // self.dtype.itemsize
        base = slot.storage_offset() // self.dtype.itemsize
        self.master_chunks[b].set_(storage, base, (self.layout.buckets[b].chunk_numel,))
        for i, inside, n in self.pieces_of[b]:
            t = self.piece_params[i]
            t.set_(storage, base + inside, (n,))
            if not state or self.inner is None:
                continue
            st = self.inner.state.get(t)
            for k, kind in enumerate(self.kinds, 1):
                v = st.get(kind) if st else None
                if not torch.is_tensor(v):
                    continue
                at = base + k * per_part + inside
                if v.numel() and v.data_ptr() != slot.data_ptr() + (at - base) * self.dtype.itemsize:
                    self.part(slot, b, k)[inside:inside + n].copy_(v.reshape(-1))  # made in memory: kept
                v.set_(storage, at, (n,))

    def _unpoint(self, b: int) -> None:
        self.master_chunks[b].set_(self._empty)
        for i, _, _ in self.pieces_of[b]:
            t = self.piece_params[i]
            t.set_(self._empty)
            st = self.inner.state.get(t) if self.inner is not None else None
            for kind in self.kinds if st else ():
                if torch.is_tensor(st.get(kind)):
                    st[kind].set_(self._empty)

    def staged(self) -> "StagedRecords":
        """A load's values, written into a file of their own until `install` (a load that fails changes nothing)."""
        self.settle()
        return StagedRecords(self)

    # ------------------------------------------------------------ questions
    def disk_bytes(self) -> dict:
        """Bytes on disk per kind of state: the masters, and the inner optimizer's."""
        chunk_bytes = sum(self.part_bytes)
        return {"master": chunk_bytes, "optimizer_state": chunk_bytes * len(self.kinds)}


class StateWalk:
    """One walk of a StateTier's records, a bucket at a time (StateTier.start_walk)."""

    def __init__(self, tier: StateTier, me: int, order: list, read: Parts, write: Parts):
        self.tier, self.me, self.order, self.read = tier, me, order, read
        self.ring = tier.ring.start(tier.file, order, lambda b: tier._span(b, read, write))
        self.current = None  # (bucket, slot) between next() and done()

    def __len__(self) -> int:
        return len(self.order)

    def next(self) -> int:
        """The next bucket, its master chunk, pieces and (read=ALL) state pointed at its record."""
        b, slot = self.ring.next()
        self.tier._holder[b] = self.me
        self.current = b, slot
        self.tier._point(b, slot, state=self.read == ALL)
        return b

    def done(self) -> None:
        """The bucket next() gave is written behind (state the step made taken into its record first)."""
        b, slot = self.current
        try:
            if self.read == ALL:
                self.tier._point(b, slot, state=True)  # state the step made
        finally:
            self._unpoint()
        self.ring.done()

    def close(self) -> None:
        """Every write of the walk done (raises if one failed)."""
        self.ring.close()

    def abandon(self) -> None:
        """The walk ends here (its user raised): what it pointed is unpointed; its transfers are left to drain."""
        self._unpoint()

    def _unpoint(self) -> None:
        if self.current is not None:
            b = self.current[0]
            self.current = None
            if self.tier._holder.get(b) == self.me:  # not a later walk's (an abandoned walk ends late)
                self.tier._unpoint(b)
                del self.tier._holder[b]


class StagedRecords:
    """A load's master values and state, piece by piece in bucket order, written a bucket at a time into a second
    scratch file; `install` makes it the tier's file, `discard` drops it."""

    def __init__(self, tier: StateTier):
        self.tier = tier
        self.file = ScratchFile(tier.config.nvme_path, "optimizer", sum(tier.record_bytes), tier.config.aio)
        self.slots = [aligned_empty(max(tier.record_bytes, default=0), torch.uint8) for _ in range(2)]
        self.bucket_of = {i: b for b, members in enumerate(tier.pieces_of) for i, _, _ in members}
        self.where = {i: (inside, n) for members in tier.pieces_of for i, inside, n in members}
        self.bucket, self.turn, self.pending = None, 0, [None, None]

    def put(self, i: int, master: torch.Tensor, slices: dict, scalars: dict) -> dict:
        """Piece i's values; returns the state the inner optimizer installs (elementwise state: placeholders)."""
        tier, b = self.tier, self.bucket_of[i]
        if unknown := set(slices) - set(tier.kinds):
            raise TierError(f"the loaded state holds {sorted(unknown)}, which this optimizer does not keep "
                            f"(its state: {list(tier.kinds)}): build the optimizer that saved it")
        if b != self.bucket:
            self._write()
            self.bucket = b
            self._wait(self.turn)
            self.slots[self.turn].zero_()
        slot, (inside, n) = self.slots[self.turn], self.where[i]
        tier.part(slot, b, 0)[inside:inside + n].copy_(master.reshape(-1))
        for k, kind in enumerate(tier.kinds, 1):
            if kind in slices:
                tier.part(slot, b, k)[inside:inside + n].copy_(slices[kind].reshape(-1))
        return {**{k: torch.empty(0, dtype=tier.dtype) for k in slices}, **scalars}

    def _write(self) -> None:
        if self.bucket is not None:
            b = self.bucket
            slot = self.slots[self.turn]
            self.pending[self.turn] = self.file.start_write(self.tier.offsets[b], slot[:self.tier.record_bytes[b]])
            self.turn = 1 - self.turn

    def _wait(self, turn: int) -> None:
        request, self.pending[turn] = self.pending[turn], None
        if request is not None:
            request.wait()

    def finish(self) -> None:
        """Every bucket written (raises if a write failed)."""
        self._write()
        self.bucket = None
        self._wait(0)
        self._wait(1)

    def install(self) -> None:
        """The staged file becomes the tier's (after every rank staged its own)."""
        self.finish()
        old, self.tier.file = self.tier.file, self.file
        old.close()

    def discard(self) -> None:
        for turn in (0, 1):
            try:
                self._wait(turn)
            except TierError:
                pass
        self.file.close()
