"""The flat layout: where every parameter lives, how the buffer is cut into buckets, who owns what.

Pure code: no process group, no tensors; its tests need only shapes and numbers.

Note [Flat layout]
------------------
Each param group gets a *region* of one flat buffer (so its hyper-parameters apply to whole chunks), its
parameters in reverse registration order, about the order backward produces gradients. A region is cut into
buckets of `bucket_numel` = reduce_bucket_size rounded up to `align = lcm(world_size, 128)`, the last one
zero-padded to `align`. Only a region's end is padded: a parameter is one contiguous run even across
buckets, so model parameters are views into the buffer.

Rank r owns chunk r of the `world_size` equal chunks of every bucket (Megatron-style; Note [Node-aware chunk
order]): a bucket's reduction is one reduce-scatter and its refresh one all-gather, both in place. A *piece*,
one parameter inside one chunk, is the unit of optimizer state: each parameter keeps its step count and is
skipped without a gradient as in torch.optim, and checkpoints keyed by (parameter, element range) load at any
world size. All-gathers cover a chunk in spans of allgather_bucket_size / world_size (rounded to 128).

Note [Node-aware chunk order]
-----------------------------
W = R * K ranks on R nodes (rank = node * K + local). Two-level collectives (Note [Two-level collectives] in
parallel/mesh_plan.py) leave local rank j the node's sum of the bucket's j-th K-part (its *node chunk*),
then node i's rank part i of that, summed over every rank. Both phases are contiguous when rank (i, j) owns
chunk j * R + i, not i * K + j:

    W = 4, R = 2 x K = 2:  rank 0 (0,0) -> chunk 0   rank 1 (0,1) -> chunk 2
                           rank 2 (1,0) -> chunk 1   rank 3 (1,1) -> chunk 3

Only `chunk_index` knows this; sizes are flat sharding's over W (a node chunk is R consecutive chunks).

Note [Stage-3 buckets hold whole parameters]
--------------------------------------------
A stage-3 parameter is a view into its bucket's storage, which exists only while gathered, so none may
straddle buckets: a bucket closes before the parameter that would cross `bucket_numel` (a larger one gets
its own) and is padded to `align` alone. `persistent` parameters (biases, norms: DeepSpeed's
stage3_param_persistence_threshold) get buckets at their region's end that stay gathered, refreshed after
each step as at stage 2: little memory for a gather saved per use.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import mmap
from typing import Sequence

CHUNK_ALIGN = 128  # elements: 512 bytes in fp32, whole cache lines and SIMD vectors for every chunk
MAP_MIN_PAGES = 16  # stage 3 maps a chunk of at least this many pages (`mappable`), copies a smaller one


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one trainable parameter lives in the flat buffer."""

    index: int  # in Layout.params: the order given, flattened over groups
    name: str  # a module path, or `group{g}.param{i}` when names are unknown
    shape: tuple[int, ...]
    group: int  # its optimizer param group
    offset: int  # first element in the flat buffer

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
    group: int  # the param group (region) it belongs to
    start: int  # first element in the flat buffer
    numel: int  # padding included; a multiple of world_size
    params: tuple[int, ...]  # the parameters that overlap it
    world_size: int  # chunks it is split into
    persistent: bool = False  # stage 3: stays gathered (Note [Stage-3 buckets hold whole parameters])
    nodes: int = 1  # node-aware collectives over this many nodes (Note [Node-aware chunk order])

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
    bucket: int  # the bucket whose chunk holds it
    start: int  # [start, end) in the flat buffer
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class GatherSpan:
    """One all-gather: elements [lo, hi) of every rank's chunk of one bucket."""

    bucket: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """The whole plan for one world size. Build with `plan_layout`."""

    world_size: int  # ranks the buckets are split over
    align: int  # every bucket's size is a multiple of lcm(world_size * replicas, 128)
    bucket_numel: int  # a full bucket: reduce_bucket_size rounded up to `align`
    params: tuple[ParamSlot, ...]  # in the order given
    buckets: tuple[Bucket, ...]  # in flat-buffer order
    gather_spans: tuple[GatherSpan, ...]  # every all-gather after a step, in order
    total_numel: int  # the flat buffer, padding included
    whole_params: bool = False  # stage 3: Note [Stage-3 buckets hold whole parameters]
    nodes: int = 1  # nodes of node-aware collectives, else 1 (Note [Node-aware chunk order])

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
    """plan_layout's `page_numel` at stage 3: elements per page where the store may map buckets, else 0; not
    whether it then does, so the layout (and every sum's order) does not depend on how gathers travel."""
    mapped = world_size > 1 and nodes == 1 and replicas == 1 and device_type in ("cpu", "meta")
    return page_numel(itemsize) if mapped else 0


def mappable(bucket: Bucket, page_numel: int) -> bool:
    """Whether stage 3 maps `bucket` (Note [Stage-3 buckets mapped, not copied] in parallel/shared_memory.py)."""
    n = bucket.chunk_numel
    return not bucket.persistent and n % page_numel == 0 and n >= MAP_MIN_PAGES * page_numel


def place_chunks(buckets: Sequence[Bucket], page_numel: int) -> tuple[list[int], int]:
    """Each bucket's chunk offset in a stage-3 shard in shared memory (mappable ones page-aligned), and its size."""
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
    """Plans the flat buffer for trainable parameters given per param group as (name, shape) (Note [Flat layout]).

    Hybrid sharding: `world_size` is the shard group's, and chunks split into `replicas` parts (Note [Hybrid
    sharding]). `whole_params`, `persistent`: Note [Stage-3 buckets hold whole parameters]. `nodes`: Note
    [Node-aware chunk order]. `page_numel` > 0: buckets that can be mapped are padded to whole pages per chunk.
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
        """The end of a whole-parameter bucket of [start, offset): padded to `align` or to pages per chunk."""
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
            for i in reversed(members):
                params[i] = dataclasses.replace(params[i], offset=offset)
                offset += params[i].numel
            region_end = _round_up(offset, align) if offset > region_start else offset
            offset = close(g, region_start, region_end, members, False)
            continue
        # Whole parameters: sharded ones first, then the persistent ones, each in reverse order.
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
    """`second`'s parameters and buckets after `first`'s (Note [Frozen parameters at stage 3] in zero3/build.py)."""
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
    """Bucket indices in the order every rank launches their reduce-scatters; `positions[i]`: parameter i's
    registration position. Backward reaches late-registered parameters first, so a bucket is complete once its
    earliest-registered one has its gradient (several param groups: interleaved as backward fills them)."""
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
