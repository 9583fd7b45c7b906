"""The flat layout: where every parameter lives, how the buffer is cut into buckets, who owns what.

Pure code: no process group, no tensors allocated. Everything the sharded
optimizer and the bucket engine do is indexed by the objects built here, and
their tests need only shapes and numbers.

Note [Flat layout]
------------------
Trainable parameters are laid out in one flat buffer. Each optimizer param
group gets its own *region* (so every bucket belongs to exactly one group and
the inner optimizer's hyper-parameters apply to whole chunks). Within a region
parameters are in reverse registration order, which is close to the order in
which backward produces their gradients, so buckets fill one after the other.

A region is cut into buckets of `bucket_numel` elements, where `bucket_numel`
is `reduce_bucket_size` rounded up to a multiple of `align = lcm(world_size,
128)`; the region's last bucket holds the rest, rounded up to `align` with zero
padding. Only the end of a region is padded, so a parameter is always one
contiguous run of the buffer even when it straddles buckets: model parameters
can be views into it.

Every bucket is split into `world_size` equal contiguous chunks and rank r owns
chunk r of every bucket (Megatron-style; a fixed permutation of that when ranks
span nodes: Note [Node-aware chunk order]). A bucket's gradient reduction is then
one reduce-scatter, and its parameter refresh one all-gather, both writing in
place. A *piece* is the intersection of one parameter with one chunk: the unit
of optimizer state. Keeping state per piece (not per flat chunk) gives every
parameter its own step count and lets a parameter with no gradient be skipped
exactly as torch.optim skips it; checkpoints are keyed by (parameter, element
range), so any world size can read them.

All-gathers follow the reduce buckets: each bucket's chunk is gathered in
sub-ranges of `allgather_bucket_size / world_size` elements (rounded to 128),
one collective each, written into a strided view of the bucket.

Note [Node-aware chunk order]
-----------------------------
When the W = R * K ranks span R nodes of K ranks (rank = node * K + local, as
torchrun numbers them), node-aware collectives (Note [Two-level collectives]
in parallel/mesh_plan.py) reduce a bucket in two phases: a reduce-scatter
inside the node leaves local rank j with the node's sum of the bucket's j-th
K-part (its *node chunk*), then an exchange across the nodes, among the R
ranks with the same local rank, leaves node i's rank with part i of that node
chunk summed over every rank. For both phases to be contiguous, rank (i, j)
owns chunk j * R + i of the bucket, not chunk i * K + j:

    W = 4, R = 2 nodes x K = 2:  rank 0 (0,0) -> chunk 0   rank 1 (0,1) -> chunk 2
                                 rank 2 (1,0) -> chunk 1   rank 3 (1,1) -> chunk 3

Only `Bucket.chunk(rank)` knows this; pieces, master chunks, gradient shards
and checkpoints (keyed by parameter name and element range) follow from it
unchanged, so a node-aware checkpoint loads at any world size and back. The
bucket and chunk sizes are those of flat sharding over W (the node chunk is R
consecutive chunks), so the alignment needs nothing more.

Note [Stage-3 buckets hold whole parameters]
--------------------------------------------
At stage 3 a bucket's full parameters exist only while it is gathered, in
storage of its own that is allocated for the gather and freed after use
(zero3/store.py). A parameter is a view into that storage, so it must not
straddle two buckets: with `whole_params=True` a bucket closes before the
parameter that would cross `bucket_numel`, and each bucket is padded to
`align` on its own (a parameter larger than `bucket_numel` gets a bucket of
its own, bigger than the others). Parameters named in `persistent` (small
ones: biases, norms; DeepSpeed's stage3_param_persistence_threshold) go into
buckets of their own at the end of their region, marked `persistent`: they
stay gathered on every rank and are refreshed after each step as at stage 2,
which costs little memory and saves a gather per use. Everything else
(pieces, reduce-scatters, checkpoints by name and element range) is the
same as with split parameters.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import mmap
from typing import Sequence

# Chunk boundaries on multiples of 128 elements keep every rank's chunk aligned
# to 512 bytes in fp32: whole cache lines and full SIMD vectors for the kernels.
CHUNK_ALIGN = 128

# A stage-3 bucket whose chunk is at least this many pages is padded to whole pages when the store may map it
# (`page_numel`: Note [Stage-3 buckets mapped, not copied] in zero3/shared_shard.py); smaller ones are copied.
MAP_MIN_PAGES = 16


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one trainable parameter lives in the flat buffer."""

    index: int
    """Position in the layout's parameter list (the order given, flattened over groups)."""
    name: str
    """The parameter's name (a module path, or `group{g}.param{i}` when names are unknown)."""
    shape: tuple[int, ...]
    """The parameter's shape."""
    group: int
    """Index of the optimizer param group it belongs to."""
    offset: int
    """First element in the flat buffer."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A run of the flat buffer reduced by one reduce-scatter."""

    index: int
    """Position in the layout's bucket list (flat-buffer order)."""
    group: int
    """The param group (region) it belongs to."""
    start: int
    """First element in the flat buffer."""
    numel: int
    """Elements, padding included; a multiple of world_size."""
    params: tuple[int, ...]
    """Indices of the parameters that overlap it."""
    world_size: int
    """Number of chunks it is split into."""
    persistent: bool = False
    """Stage 3: its parameters stay gathered (Note [Stage-3 buckets hold whole parameters])."""
    nodes: int = 1
    """Node-aware collectives: the ranks span this many nodes (Note [Node-aware chunk order])."""

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def chunk_numel(self) -> int:
        return self.numel // self.world_size

    def chunk(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's chunk, in flat-buffer elements."""
        s = self.start + chunk_index(rank, self.world_size, self.nodes) * self.chunk_numel
        return s, s + self.chunk_numel


def chunk_index(rank: int, world_size: int, nodes: int = 1) -> int:
    """Which of a bucket's world_size chunks `rank` owns (Note [Node-aware chunk order])."""
    if nodes == 1:
        return rank
    node, local = divmod(rank, world_size // nodes)
    return local * nodes + node


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's chunk: the unit of optimizer state."""

    param: int
    """Index of the parameter."""
    bucket: int
    """Index of the bucket whose chunk holds it."""
    start: int
    """First element in the flat buffer."""
    end: int
    """One past the last element in the flat buffer."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class GatherSpan:
    """One all-gather: elements [lo, hi) of every rank's chunk of one bucket."""

    bucket: int
    """Index of the bucket."""
    lo: int
    """Offset inside each chunk where the span starts."""
    hi: int
    """Offset inside each chunk where the span ends."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """The whole plan for one world size. Build with `plan_layout`."""

    world_size: int
    """Ranks the buckets are split over."""
    align: int
    """Every bucket's size is a multiple of this (lcm(world_size * replicas, 128))."""
    bucket_numel: int
    """Size of a full bucket (reduce_bucket_size rounded up to `align`)."""
    params: tuple[ParamSlot, ...]
    """Every trainable parameter, in the order given."""
    buckets: tuple[Bucket, ...]
    """Every bucket, in flat-buffer order."""
    gather_spans: tuple[GatherSpan, ...]
    """Every all-gather issued after a step, in order."""
    total_numel: int
    """Size of the flat buffer, padding included."""
    whole_params: bool = False
    """No parameter straddles two buckets (stage 3; Note [Stage-3 buckets hold whole parameters])."""
    nodes: int = 1
    """Nodes the ranks span with node-aware collectives; 1 otherwise (Note [Node-aware chunk order])."""

    def shard_numel(self) -> int:
        """Elements rank r owns (the same for every rank)."""
        return sum(b.chunk_numel for b in self.buckets)

    def chunk_offsets(self) -> tuple[int, ...]:
        """Where each bucket's chunk starts in a rank's concatenated shard."""
        out, at = [], 0
        for b in self.buckets:
            out.append(at)
            at += b.chunk_numel
        return tuple(out)

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """Rank's pieces, in flat-buffer order."""
        out = []
        for b in self.buckets:
            cs, ce = b.chunk(rank)
            for pi in b.params:
                p = self.params[pi]
                s, e = max(cs, p.offset), min(ce, p.end)
                if s < e:
                    out.append(Piece(param=pi, bucket=b.index, start=s, end=e))
        return tuple(out)

    def signature(self) -> list[str]:
        """One line per fact ranks must agree on; compared across ranks at construction."""
        lines = [f"world_size={self.world_size} bucket_numel={self.bucket_numel} total={self.total_numel} "
                 f"whole_params={self.whole_params} nodes={self.nodes}"]
        lines += [f"param {p.index} {p.name} shape={list(p.shape)} group={p.group} offset={p.offset}"
                  for p in self.params]
        lines += [f"bucket {b.index} group={b.group} start={b.start} numel={b.numel} persistent={b.persistent}"
                  for b in self.buckets]
        lines.append("gathers " + " ".join(f"{g.bucket}:{g.lo}-{g.hi}" for g in self.gather_spans))
        return lines

    def digest(self) -> str:
        return hashlib.sha256("\n".join(self.signature()).encode()).hexdigest()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def page_numel(itemsize: int) -> int:
    """Elements of `itemsize` bytes per memory page."""
    return mmap.PAGESIZE // itemsize


def stage3_page_numel(world_size: int, nodes: int, replicas: int, device_type: str, itemsize: int) -> int:
    """`page_numel` for plan_layout at stage 3: elements per memory page where the store may map buckets (the
    CPU, one level of W > 1 ranks; "meta": a model built on the meta device, materialized on the CPU), else 0.
    On the CPU the padding does not wait to know whether shared memory will be used, so the layout (and the
    order of every sum) does not depend on the way the gathers travel."""
    mapped = world_size > 1 and nodes == 1 and replicas == 1 and device_type in ("cpu", "meta")
    return page_numel(itemsize) if mapped else 0


def mappable(bucket: Bucket, page_numel: int) -> bool:
    """Whether stage 3 maps `bucket` instead of copying it (Note [Stage-3 buckets mapped, not copied] in
    zero3/shared_shard.py): not persistent, its chunk whole pages, at least MAP_MIN_PAGES of them."""
    n = bucket.chunk_numel
    return not bucket.persistent and n % page_numel == 0 and n >= MAP_MIN_PAGES * page_numel


def place_chunks(buckets: Sequence[Bucket], page_numel: int) -> tuple[list[int], int]:
    """Where each bucket's chunk lies in a stage-3 shard held in shared memory (elements), and the shard's size:
    one after the other, a mappable bucket's on a page boundary."""
    offsets, at = [], 0
    for b in buckets:
        if mappable(b, page_numel):
            at = _round_up(at, page_numel)
        offsets.append(at)
        at += b.chunk_numel
    return offsets, at


def plan_layout(groups: Sequence[Sequence[tuple[str, tuple[int, ...]]]], world_size: int,
                reduce_bucket_size: int, allgather_bucket_size: int, replicas: int = 1, *,
                whole_params: bool = False, persistent: frozenset = frozenset(), nodes: int = 1,
                page_numel: int = 0) -> Layout:
    """Plans the flat buffer for trainable parameters given per param group as (name, shape).

    Parameters keep the given order in `Layout.params`; the buffer holds each
    group's parameters in reverse order (see Note [Flat layout]). With hybrid
    sharding, `world_size` is the shard group's size and `replicas` the number
    of replicas: buckets are padded so that each chunk also splits into
    `replicas` equal parts (the inter-node hop; Note [Hybrid sharding]).
    `whole_params` and `persistent` (indices into the flattened parameter list)
    are stage 3's: Note [Stage-3 buckets hold whole parameters]. `nodes` > 1: the
    world_size ranks span that many nodes and use node-aware collectives (Note
    [Node-aware chunk order]). `page_numel` > 0 (elements per memory page; stage 3 on one host): a bucket that is
    not persistent and whose chunk has at least MAP_MIN_PAGES pages is padded until every chunk is whole pages,
    so that the store can map it instead of copying it (Note [Stage-3 buckets mapped, not copied] in
    zero3/shared_shard.py).
    """
    if world_size < 1 or replicas < 1:
        raise ValueError(f"world_size and replicas must be >= 1, got {world_size} and {replicas}")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"{world_size} ranks do not split over {nodes} nodes of equal size")
    if nodes > 1 and replicas > 1:
        raise ValueError("node-aware collectives are for flat sharding; hybrid sharding (replicas > 1) already "
                         "crosses the link once per gradient")
    for what, v in (("reduce_bucket_size", reduce_bucket_size), ("allgather_bucket_size", allgather_bucket_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{what} must be a positive number of elements, got {v!r}")
    if persistent and not whole_params:
        raise ValueError("persistent parameters need whole_params=True (stage 3)")
    align = math.lcm(world_size * replicas, CHUNK_ALIGN)
    bucket_numel = _round_up(reduce_bucket_size, align)
    page_align = math.lcm(align, world_size * page_numel) if page_numel else 0

    def bucket_end(start: int, offset: int, keep: bool) -> int:
        """Where a whole-parameter bucket of [start, offset) ends: padded to `align`, or to whole pages per chunk."""
        end = _round_up(offset, align)
        if page_align and not keep and (end - start) // world_size >= MAP_MIN_PAGES * page_numel:
            end = start + _round_up(end - start, page_align)
        return end

    params: list[ParamSlot] = []
    buckets: list[Bucket] = []
    offset = 0

    def close(g: int, start: int, end: int, members, keep: bool) -> int:
        """Buckets covering [start, end) (end already aligned); returns end."""
        for bstart in range(start, end, end - start if whole_params else bucket_numel):
            bend = min(bstart + bucket_numel, end) if not whole_params else end
            overlapping = tuple(sorted((i for i in members
                                        if params[i].numel and params[i].offset < bend and params[i].end > bstart),
                                       key=lambda i: params[i].offset))
            buckets.append(Bucket(index=len(buckets), group=g, start=bstart, numel=bend - bstart,
                                  params=overlapping, world_size=world_size, persistent=keep, nodes=nodes))
        return end

    for g, group in enumerate(groups):
        first = len(params)
        for name, shape in group:
            params.append(ParamSlot(index=len(params), name=name, shape=tuple(int(s) for s in shape),
                                    group=g, offset=-1))
        members = range(first, len(params))
        if not whole_params:
            region_start = offset
            # Reverse registration order inside the region (see Note [Flat layout]).
            for i in reversed(members):
                params[i] = dataclasses.replace(params[i], offset=offset)
                offset += params[i].numel
            region_end = _round_up(offset, align) if offset > region_start else offset
            offset = close(g, region_start, region_end, members, False)
            continue
        # Whole parameters: sharded ones first, then the persistent ones (each kind in reverse order).
        for keep in (False, True):
            start, placed = offset, []
            for i in reversed(members):
                if (i in persistent) != keep:
                    continue
                n = params[i].numel
                if offset > start and offset + n - start > bucket_numel:
                    offset = close(g, start, bucket_end(start, offset, keep), placed, keep)
                    start, placed = offset, []
                params[i] = dataclasses.replace(params[i], offset=offset)
                placed.append(i)
                offset += n
            if offset > start:
                offset = close(g, start, bucket_end(start, offset, keep), placed, keep)

    span = max(CHUNK_ALIGN, _round_up(max(1, allgather_bucket_size // world_size), CHUNK_ALIGN))
    gather_spans = tuple(GatherSpan(bucket=b.index, lo=lo, hi=min(lo + span, b.chunk_numel))
                         for b in buckets for lo in range(0, b.chunk_numel, span))
    return Layout(world_size=world_size, align=align, bucket_numel=bucket_numel, params=tuple(params),
                  buckets=tuple(buckets), gather_spans=gather_spans, total_numel=offset, whole_params=whole_params,
                  nodes=nodes)


def append_layout(first: Layout, second: Layout) -> Layout:
    """`second`'s parameters and buckets after `first`'s, as one layout: their indices, groups and offsets
    shifted past `first`'s (stage 3 shards frozen parameters in buckets after the trainable ones: Note
    [Frozen parameters at stage 3] in zero3/store.py). `first`'s buckets and chunks are unchanged."""
    if (first.world_size, first.nodes, first.whole_params) != (second.world_size, second.nodes, second.whole_params):
        raise ValueError("append_layout: the layouts differ in world size, nodes or whole_params")
    n_params, n_buckets, at = len(first.params), len(first.buckets), first.total_numel
    groups = 1 + max((p.group for p in first.params), default=-1)
    params = tuple(dataclasses.replace(p, index=p.index + n_params, offset=p.offset + at, group=p.group + groups)
                   for p in second.params)
    buckets = tuple(dataclasses.replace(b, index=b.index + n_buckets, start=b.start + at, group=b.group + groups,
                                        params=tuple(i + n_params for i in b.params)) for b in second.buckets)
    spans = tuple(dataclasses.replace(s, bucket=s.bucket + n_buckets) for s in second.gather_spans)
    return dataclasses.replace(first, params=first.params + params, buckets=first.buckets + buckets,
                               gather_spans=first.gather_spans + spans, total_numel=at + second.total_numel)


def plan_launch_order(layout: Layout, positions: Sequence[int]) -> tuple[int, ...]:
    """Bucket indices in the order every rank launches their reduce-scatters.

    `positions[i]` is parameter i's registration position in the model. Backward
    reaches the latest-registered parameters first, so a bucket is expected to
    be complete once its earliest-registered parameter has its gradient. With one
    param group this is flat-buffer order; with several (say decay / no-decay),
    it interleaves the groups' buckets the way backward fills them. Every rank
    computes the same order from the same (checked) layout and model.
    """
    if len(positions) != len(layout.params):
        raise ValueError(f"need one position per parameter ({len(layout.params)}), got {len(positions)}")

    def expected_ready(b: Bucket) -> tuple[int, int]:
        first = min((positions[i] for i in b.params), default=-1)
        return (-first, b.index)

    return tuple(b.index for b in sorted(layout.buckets, key=expected_ready))


def first_difference(mine: Sequence[str], theirs: Sequence[str]) -> str | None:
    """The first line where two signatures differ, phrased for an error message."""
    for a, b in zip(mine, theirs):
        if a != b:
            return f"this rank has '{a}' where the other has '{b}'"
    if len(mine) != len(theirs):
        extra = mine[len(theirs)] if len(mine) > len(theirs) else theirs[len(mine)]
        return f"one rank has more entries, first extra: '{extra}'"
    return None
