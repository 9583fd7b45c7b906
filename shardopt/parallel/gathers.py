"""How every rank's chunks of a bucket reach every rank: the one gatherer of a parameter store, chosen once.

    gather = open_bucket_gather(layout, dtype, sharding, config, device)   # stage 3 (a collective)
    gather.shard, gather.chunks            # where this rank's chunks live between gathers
    work = gather.start(b, chunk, out)     # every rank's chunk of bucket b into `out`; work.wait() / work.drop()
    gather.mapping(b)                      # or: bucket b whole as a mapping of every rank's chunk (no copy)

    flat, gather = open_flat_gather(layout, dtype, sharding, config, device)   # stages 1-2 (a collective)
    gather.start_all_gather_params(flat); gather.finish_all_gather(b); gather.finish_all_gather_params()

Note [One gatherer]
-------------------
A gather's route follows from the shard group and the layout alone, so it is decided once, here, when the
store is built (`choose_route`), and both stores use what this module gives them:
  ONE_RANK       one rank in the shard group: a bucket's chunk is the whole bucket, nothing moves (stage 3's
                 bucket storage is then the chunk itself: Note [One rank holds the whole bucket] in
                 zero3/buckets.py).
  SHARED_MEMORY  every rank of the group on this host: chunks are copied out of the peers' buffers in
                 /dev/shm, or, for a stage-3 bucket whose chunks are whole pages, mapped end to end (Note
                 [Gathering through shared memory], Note [Stage-3 buckets mapped, not copied] in
                 shared_memory.py).
  TWO_LEVEL      ranks on several nodes with node-aware collectives: across the nodes into the node chunk,
                 then inside the node (Note [Two-level collectives] in mesh_plan.py); a pass's gathers may
                 cross the nodes rounded (Note [Stage 3's parameters across nodes, rounded] there).
  FLAT           one all-gather over the shard group (shardopt's ring on gloo, the group's own elsewhere).
At stages 1-2 the gather after a step covers the whole flat buffer: through the shared buffers, or the
bucket engine's collectives, which run flat or in two levels as the node groups it was given say (the
same decision: the engine gets node groups exactly when the route is TWO_LEVEL).

The parameter tier plugs in there: a stage-3 bucket's chunk reaches its gather as the tensor handed to `start`,
held in memory for it (Note [The parameter shard on disk] in tiers/param_shard.py); its gathers are FLAT or
TWO_LEVEL, every rank's shard being on its own disk.
"""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from shardopt.layout import page_numel, place_chunks
from shardopt.parallel import comm
from shardopt.parallel.mesh import copy_group, two_level_groups
from shardopt.parallel.shared_memory import SharedChunks, open_shared_flat, why_not_shared


# inter_node_param_dtype -> the two-level gather's across_dtype (csrc/comm/two_level.h; int8: block-scaled).
PHASE_DTYPES = {None: None, torch.bfloat16: torch.bfloat16, "int8": torch.int8}


class Route(str, enum.Enum):
    """How a bucket's chunks reach every rank (Note [One gatherer])."""
    ONE_RANK = "one rank"
    SHARED_MEMORY = "shared memory"
    TWO_LEVEL = "two-level"
    FLAT = "flat"


def choose_route(shard_size: int, node_aware: bool, shared: bool) -> Route:
    """The route for a shard group of `shard_size` ranks (pure). node_aware: the ranks span nodes with
    node-aware collectives; shared: every rank's buffer is in shared memory (the handshake agreed)."""
    if shard_size == 1 and not node_aware:
        return Route.ONE_RANK
    if shared:
        return Route.SHARED_MEMORY
    return Route.TWO_LEVEL if node_aware else Route.FLAT


class _Done:
    """A gather with nothing left to do (one rank, a mapped bucket)."""

    @staticmethod
    def wait():
        return None

    drop = wait


DONE = _Done()


class _Copy:
    """A bucket's gather through shared memory, as a collective's Work: wait() copies (once), drop() forgets.
    The copy is made when waited for: a bucket gathered only to be freed unused is never copied."""

    __slots__ = ("chunks", "b", "out")

    def __init__(self, chunks: SharedChunks, b: int, out: torch.Tensor):
        self.chunks, self.b, self.out = chunks, b, out

    def wait(self) -> None:
        if self.out is not None:
            self.chunks.copy(self.b, self.out)
            self.out = None

    def drop(self) -> None:
        self.out = None


class BucketGather:
    """Stage 3's gathers, bucket by bucket, on groups of their own (the bucket engine's reduce-scatters run on
    the shard group in backward at the same time, in an order of their own)."""

    def __init__(self, route: Route, shard: torch.Tensor, chunks: list, shared: SharedChunks | None,
                 process_group, nodes, impl: str, across: torch.dtype | None = None):
        self.route, self.shard, self.chunks, self.shared, self.impl = route, shard, chunks, shared, impl
        self.group = self.node_group = self.across_group = None
        self.across = across  # a pass's gathers across nodes in this format (torch.int8: block-scaled), or exact
        if route is Route.TWO_LEVEL:
            self.node_group, self.across_group = two_level_groups(nodes, process_group)
        elif route is not Route.ONE_RANK:
            self.group = copy_group(process_group)
        if across is not None and route is not Route.TWO_LEVEL:
            raise ValueError(f"the parameters cross nodes rounded only in two-level gathers, not {route.value} ones")

    def start(self, b: int, chunk: torch.Tensor, out: torch.Tensor, exact: bool = False):
        """Starts every rank's chunk of bucket b (this rank's is `chunk`) into `out`; returns what to wait() on.
        A pass's gathers may round across nodes; exact=True: whole weights (every rank passes the same)."""
        if self.route is Route.ONE_RANK:
            return DONE
        if self.shared is not None and self.shared.holds(b):
            return _Copy(self.shared, b, out)
        if self.route is Route.TWO_LEVEL:
            return comm.start_two_level_all_gather(chunk, out, self.node_group, self.across_group, impl=self.impl,
                                                   across_dtype=None if exact else self.across)
        return comm.start_all_gather(chunk, out, group=self.group, impl=self.impl)

    def through_shared_memory(self, b: int) -> bool:
        """Whether bucket b is gathered by copying out of the shards in shared memory: no collective, so no
        peer waits for this rank's part."""
        return self.shared is not None and self.shared.holds(b)

    def mappable(self) -> set:
        """Buckets that `mapping` can give."""
        return set(self.shared.mappable) if self.shared is not None else set()

    def mapping(self, b: int) -> torch.Tensor | None:
        return self.shared.mapping(b) if self.shared is not None else None

    def add_frozen(self, buckets, dtype: torch.dtype, group) -> list[torch.Tensor] | None:
        """A collective over `group`: frozen `buckets`' chunks in shared memory beside the shard, gathered as the
        shard's are; returns this rank's chunk of each, or None (they are gathered by the process group)."""
        if self.shared is None:
            return None
        offsets, numel = place_chunks(buckets, page_numel(dtype.itemsize))
        region = open_shared_flat(numel, dtype, group, None, None)
        return self.shared.add(region, buckets, offsets) if region is not None else None

    # Read phases (Note [Gathering through shared memory]); nothing to do without shared memory.
    def end_reads(self) -> None:
        if self.shared is not None:
            self.shared.end_reads()

    def wait_readers(self) -> None:
        if self.shared is not None:
            self.shared.wait_readers()

    def sync(self) -> None:
        if self.shared is not None:
            self.shared.sync()


def open_bucket_gather(layout, dtype: torch.dtype, sharding, config, device: torch.device,
                       on_disk: list | None = None) -> BucketGather:
    """A collective over the shard group: stage 3's shard (in shared memory where it can be) and its gathers.
    on_disk: the parameter tier's chunks, which live on disk (gathered through the process group)."""
    group, nodes = sharding.shard, sharding.nodes
    across = PHASE_DTYPES[config.inter_node_param_dtype]  # validated with the groups (mesh_plan.param_phase_dtype)
    if on_disk is not None:
        route = choose_route(dist.get_world_size(group), nodes is not None, False)
        return BucketGather(route, torch.empty(0, dtype=dtype, device=device), on_disk, None, group, nodes,
                            config.comm_impl, across)
    shared = chunks = None
    why = why_not_shared(device, nodes is not None, dist.get_process_group_ranks(group), dist.get_world_size())
    offsets, numel = place_chunks(layout.buckets, page_numel(dtype.itemsize))
    region = open_shared_flat(numel, dtype, group, config.shared_memory_gather, why)
    if region is not None and region.barrier is None:
        if config.shared_memory_gather:
            raise RuntimeError("shared_memory_gather=True at stage 3 needs the shared-memory barrier (x86, one pid "
                               "namespace: Note [Barriers in shared memory]); pass None to use the process group")
        region = None
    if region is not None:
        shared = SharedChunks(region, "the barrier of stage 3's parameter gathers through shared memory")
        chunks = shared.add(region, layout.buckets, offsets)
        shard = region.flat
    else:
        shard = torch.empty(layout.shard_numel(), dtype=dtype, device=device)
        chunks = [shard[at:at + b.chunk_numel] for b, at in zip(layout.buckets, layout.chunk_offsets())]
    route = choose_route(dist.get_world_size(group), nodes is not None, shared is not None)
    return BucketGather(route, shard, chunks, shared, group, nodes, config.comm_impl, across)


class SharedAfterStep:
    """Stages 1-2's gather after a step through the shared flat buffers: the same calls as the bucket engine's
    (start_all_gather_params, finish_all_gather(bucket), finish_all_gather_params, num_pending_gathers), plus
    wait_readers() before this rank's chunks are written again."""

    route = Route.SHARED_MEMORY

    def __init__(self, layout, shared: SharedChunks):
        self.shared = shared
        shared.add_in_place(layout.buckets)
        self.buckets = range(len(layout.buckets))
        self.pending: set[int] = set()
        self.written = None  # every rank's own chunks hold this step's values
        self.num_all_gathers = 0

    def attach(self, engine) -> None:
        pass

    @property
    def num_pending_gathers(self) -> int:
        return len(self.pending)

    def start_all_gather_params(self, flat: torch.Tensor) -> None:
        if self.pending:
            raise RuntimeError("start_all_gather_params: the previous all-gather of parameters was not finished")
        self.shared.wait_readers()
        self.written = self.shared.arrive()
        self.pending = set(self.buckets)
        self.num_all_gathers += len(self.pending)

    def finish_all_gather(self, bucket: int) -> None:
        if bucket not in self.pending:
            return
        self.written.wait()
        self.shared.copy(bucket, self.shared.shared.flat)
        self.pending.discard(bucket)
        if not self.pending:
            self.written = None
            self.shared.end_reads()

    def finish_all_gather_params(self) -> None:
        for b in sorted(self.pending):
            self.finish_all_gather(b)

    def wait_readers(self) -> None:
        self.shared.wait_readers()


class EngineAfterStep:
    """Stages 1-2's gather after a step by the bucket engine's collectives (flat, or in two levels)."""

    def __init__(self, route: Route):
        self.route, self.shared, self.engine = route, None, None

    def attach(self, engine) -> None:
        self.engine = engine

    @property
    def num_pending_gathers(self) -> int:
        return self.engine.num_pending_gathers

    @property
    def num_all_gathers(self) -> int:
        return self.engine.num_all_gathers

    def start_all_gather_params(self, flat: torch.Tensor) -> None:
        self.engine.start_all_gather_params(flat)

    def finish_all_gather(self, bucket: int) -> None:
        self.engine.finish_all_gather(bucket)

    def finish_all_gather_params(self) -> None:
        self.engine.finish_all_gather_params()

    def wait_readers(self) -> None:
        pass


def open_flat_gather(layout, dtype: torch.dtype, sharding, config, device: torch.device):
    """A collective over the shard group: stages 1-2's flat parameter buffer (in shared memory where it can be,
    zero-filled) and the gather after a step; returns (flat, gather)."""
    group, nodes = sharding.shard, sharding.nodes
    why = why_not_shared(device, nodes is not None, dist.get_process_group_ranks(group), dist.get_world_size())
    region = open_shared_flat(layout.total_numel, dtype, group, config.shared_memory_gather, why)
    route = choose_route(dist.get_world_size(group), nodes is not None, region is not None)
    if route is Route.SHARED_MEMORY:
        shared = SharedChunks(region, "the barrier of the parameter gather through shared memory")
        return region.flat, SharedAfterStep(layout, shared)
    return torch.zeros(layout.total_numel, dtype=dtype, device=device), EngineAfterStep(route)
