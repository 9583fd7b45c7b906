"""Stage 3's parameter store: this rank's shard, and the life cycle of a bucket's full parameters.

Between uses each rank holds only its chunk of every bucket (`shard`, the
chunks concatenated in bucket order, in the model's dtype). A bucket's full
parameters live in storage of their own (`full[b]`; Note [Stage-3 buckets
hold whole parameters] in layout.py) that exists only while the bucket is
gathered: a gather allocates it and all-gathers every rank's chunk into it
(in two levels over ranks on several nodes: Note [Two-level collectives] in
parallel/mesh_plan.py), a free gives the memory back. Which gather comes
when is Note [Stage-3 schedule] in zero3/schedule.py; this module carries it out,
and zero3/hooks.py is where the model's modules and autograd call into it.

Note [Parameters between gathers]
---------------------------------
A gathered parameter is a view of its bucket's storage. When the bucket is
freed, the parameter's `.data` becomes an empty tensor of its dtype (as
DeepSpeed's stage 3 does), so code that reads a weight outside a forward
gets an obvious shape error instead of freed memory; `opt.full_params()`
gathers everything for such code. Autograd saves weights for backward
(x @ W saves W); a saved view of a bucket is packed as (bucket, the view) and
unpacked by asking for the bucket again, which is what moves the backward
round forward (a weight backward never reads: Note [Gradients of parameters
not gathered]). The view itself stays valid across a free and a gather: a
free resizes the bucket's storage to nothing and a gather back, keeping the
storage object the view points at, and a parameter gets its view back as
`.data` when its bucket is gathered (`_show`). (It was packed as bucket, size,
stride and offset and rebuilt at unpack: three Python calls per saved weight.) Gathers write through a second tensor on the same
storage (`_comm`), so autograd's version counter of the parameters' views is
not bumped by the collective that refills them.

Note [Gradients of parameters not gathered]
-------------------------------------------
Some weights are never read in backward: an embedding's (its backward needs
the indices only), a first Linear's on an input without grad (grad_W needs
the input, not W). Its bucket may then be free (or still gathering) when its
gradient arrives, and autograd's AccumulateGrad would check the new
gradient's layout against the parameter's sizes and strides: against an
empty placeholder a 2-d gradient fails ("The size of tensor a (0) must match
the size of tensor b (64)"). Gathering the bucket only for that check would
cost a collective and the memory of, say, a vocabulary embedding, for
nothing. So nothing is ever accumulated into a stage-3 parameter: its C++
hook takes the gradient before AccumulateGrad runs and hands it to the
bucket engine (or, under no_sync, into p.grad itself), leaving AccumulateGrad
nothing to check (Note [Stage 3's gradient hooks in C++] in
csrc/comm/grad_hooks.h). (Before, a one-element stand-in of the parameter's
shape was swapped in for the accumulation and out after it.)
"""
from __future__ import annotations

import bisect
import contextlib
import enum
import operator
import time
import warnings

import torch
import torch.distributed as dist

from shardopt.layout import Layout, append_layout, page_numel, plan_layout, stage3_page_numel
from shardopt.param_store import ParamStore
from shardopt.parallel import comm
from shardopt.parallel.mesh import copy_group, two_level_groups
from shardopt.prefetch import plan_forward_waits
from shardopt.zero3 import hooks
from shardopt.parallel.shared_flat import why_not_shared
from shardopt.parallel.shm_exchange import open_shm_exchange
from shardopt.zero3.shared_shard import open_frozen_region, open_shared_shard
from shardopt.zero3.passes import Intent, describe, exchange
from shardopt.zero3.schedule import Stage3Schedule, plan_stage3_schedule


_STORAGE_CDATA = operator.attrgetter("_cdata")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


class _Gathered:
    """The gather of a bucket that one rank holds whole, or that is mapped: nothing to wait for."""

    @staticmethod
    def wait():
        return None

    drop = wait


_NOTHING_TO_GATHER = _Gathered()


class BucketState(str, enum.Enum):
    """Where a bucket's full parameters are: FREE (no storage) -start_gather-> GATHERING (storage, a
    collective writing it) -finish_gather-> LIVE (its parameters are views of it) -reshard-> FREE."""
    FREE = "free"
    GATHERING = "gathering"
    LIVE = "live"


FREE, GATHERING, LIVE = BucketState.FREE, BucketState.GATHERING, BucketState.LIVE


class Pass(str, enum.Enum):
    """Which pass a round walks the schedule for (Note [Stage-3 schedule])."""
    FORWARD = "forward"
    BACKWARD = "backward"


class _Round:
    """One pass of the schedule (Note [Stage-3 schedule]): which gathers were issued, what may be freed."""

    def __init__(self, kind: Pass, order: tuple, users: tuple, carried: frozenset = frozenset()):
        self.kind = kind
        self.order = order
        self.position = {b: i for i, b in enumerate(order)}
        self.pos = 0                     # next position of `order` to issue
        # Buckets of `order` gathered when the round began (the seam a forward kept for its backward): the
        # walk never gathers them again, even where this rank has freed them since (Note [Stage-3 schedule]).
        self.carried = carried
        self.needed = -1                 # the furthest position a module has asked for
        self.users = list(users)         # forward: modules still to run per bucket
        self.ran: set[int] = set()       # forward: ids of the modules that ran (first call counts)
        # forward: buckets every waiting module has used, kept until a module needs another bucket (or the
        # forward ends), so that a module called again at once finds them (Note [A module called again]).
        self.spent: dict[int, frozenset] = {}  # bucket -> its scope
        self.serves = False              # forward: it ends by serving gathers asked again (_serve)
        self.training = False            # forward: a backward will follow (it keeps the seam)


class _AfterBackward(torch.autograd.Function):
    """The identity on a module's inputs; its backward (the module's input gradients are done) tells the
    store (Note [Frozen parameters at stage 3])."""

    @staticmethod
    def forward(ctx, store, buckets, *inputs):
        ctx.store, ctx.buckets = store, buckets
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.store.backward_done(ctx.buckets)
        return (None, None) + grads


class ShardedStore(ParamStore):
    """This rank's chunks of the parameters and the buckets gathered now (stage 3; Note [One parameter
    store] in param_store.py)."""

    waits_in_backward = False  # Note [Stage 3 never waits in backward] in csrc/comm/bucket_engine.cpp
    holds_whole = False        # a parameter is an empty tensor between uses (Note [Parameters between gathers])

    @classmethod
    def plan(cls, names, world_size, config, sizes, replicas, nodes, params) -> Layout:
        """Buckets of whole parameters; those of at most param_persistence_threshold elements stay gathered
        (Note [Stage-3 buckets hold whole parameters] in layout.py)."""
        persistent = frozenset(i for i, p in enumerate(params) if p.numel() <= config.param_persistence_threshold)
        per_page = stage3_page_numel(world_size, nodes, replicas, params[0].device.type,
                                     params[0].element_size()) if params else 0
        return plan_layout(names, world_size, *sizes, replicas=replicas, whole_params=True, persistent=persistent,
                           nodes=nodes, page_numel=per_page)

    def __init__(self, layout: Layout, rank: int, params: list, sharding, config, device, phase: dict):
        process_group, world_group, nodes = sharding.shard, sharding.world, sharding.nodes
        bucket = layout.bucket_numel
        self.layout = layout
        self.rank = rank
        self.params = params
        self.impl = config.comm_impl
        self.prefetch = 1 if config.prefetch_bucket_size is None else -(-config.prefetch_bucket_size // bucket)
        self.max_live = None if config.max_live_parameters is None else max(1, config.max_live_parameters // bucket)
        self.reshard_after_forward = config.reshard_after_forward
        self.phase = phase
        # No trainable parameter: a model sharded for inference, all of it frozen buckets (Note [Models sharded
        # for inference] in zero3/inference.py); the optimizer's shard is then empty.
        self.dtype, self.device = params[0].dtype if params else torch.get_default_dtype(), device
        self.flat_grad, self.resting_grads = None, [None] * len(params)  # gradients: only this rank's chunks
        self.engine = None
        self.grad_hooks = None  # the C++ gradient hooks of the wrapper attached now (hooks.install)
        self.world_size = dist.get_world_size(process_group)
        # Parameter gathers run on groups of their own, with the world's timeout: the bucket engine's
        # reduce-scatters run on `process_group` (or its node groups) in backward at the same time, in an
        # order of their own. Over ranks on several nodes (`nodes`: node-aware flat sharding) they gather
        # in two levels (Note [Two-level collectives] in parallel/mesh_plan.py): the chunks are then in the
        # node-aware order (Note [Node-aware chunk order] in layout.py), which a flat all-gather in rank
        # order would put in the wrong places.
        self.nodes = nodes
        self.group = self.node_group = self.across_group = None
        if nodes is not None:
            self.node_group, self.across_group = two_level_groups(nodes, process_group)
        else:
            self.group = copy_group(process_group) if self.world_size > 1 else process_group
        # Which pass each rank starts next (Note [Passes every rank agrees on] in passes.py).
        self.agree_group = copy_group(process_group, backend="gloo") if self.world_size > 1 else None
        # On one host through shared memory (Note [Agreements in shared memory] in parallel/shm_exchange.py).
        self.agree_shm = open_shm_exchange(self.agree_group) if self.agree_group is not None else None
        self.passes_started, self.last_intent = 0, None
        self.join_agree = None  # under torch's Join the agreement is its (Note [Join] in shardopt/join.py)
        self.members = list(params)  # every parameter held: the trainable ones, then frozen ones (adopt)
        self.trainable_buckets = len(layout.buckets)  # buckets from here on hold frozen parameters
        self.persistence_threshold = config.param_persistence_threshold
        self._empty: dict = {}  # dtype -> the one empty tensor freed parameters of that dtype hold
        self.placeholder = self._empty_of(self.dtype)
        self._empty_storage = self.placeholder.untyped_storage()._cdata
        # On one host the shard is in shared memory and gathers copy out of the peers' (Note [Stage 3's gathers
        # through shared memory] in shared_shard.py).
        why = why_not_shared(device, nodes is not None, dist.get_process_group_ranks(process_group),
                             dist.get_world_size())  # one rank, several nodes, a GPU: the reason, or None
        self.shared_gather = open_shared_shard(layout, self.dtype, process_group, config.shared_memory_gather, why)
        if self.shared_gather is not None:
            self.shard, self.chunks = self.shared_gather.shard, list(self.shared_gather.chunks)
        else:
            self.shard = torch.empty(layout.shard_numel(), dtype=self.dtype, device=self.device)
            self.chunks = [self.shard[at:at + b.chunk_numel] for b, at in zip(layout.buckets, layout.chunk_offsets())]
        offsets = layout.chunk_offsets()
        # Note [One rank holds the whole bucket]: its buckets' full storage is its chunks, found by offset.
        self.aliased = self.world_size == 1 and nodes is None
        self._shard_storage = self.shard.untyped_storage()._cdata
        self._chunk_starts = [offsets[b.index] for b in layout.buckets]
        self.every_chunk = list(self.chunks)  # every bucket's, frozen ones included (chunks: the optimizer's)
        self.frozen_shard_bytes = 0
        self.views: list = []
        self._lo, self.full, self._comm, self.state, self.owed = [], [], [], [], []
        # Note [Stage-3 buckets mapped, not copied] in shared_shard.py: bucket -> its mapping, made at the first
        # pass (`_install_maps`); `_mapped[b]`, for a bucket shown through its mapping now, the private storage it
        # had (full_params' copies use it again).
        self.maps: dict[int, torch.Tensor] = {}
        self._mapped: dict[int, tuple] = {}
        self._to_map: set[int] = set()
        self.bucket_params: list[list[int]] = []
        self._bucket_of_param: list[list[int]] = []  # whole parameters: one bucket each
        self._bucket_of_storage: dict = {}
        self._add_buckets(layout.buckets, self.dtype)
        self.held: set = set()  # frozen buckets some forward used with no input needing a gradient
        self.handles: dict[int, object] = {}
        self.schedule: Stage3Schedule | None = None  # set when ShardedDDP attaches (it knows the modules)
        self._seam: frozenset = frozenset()  # Note [The seam between forward and backward]
        self.round: _Round | None = None
        self.backwards_owed = 0  # grad-enabled forwards whose backward round has not run on this rank
        self.num_gathers = 0
        self.num_again = 0  # of those, gathers some rank asked for again (Note [A module called again])
        self._in_place_seen: list = []  # Note [Parameters in place, checked in C]
        self.live = 0  # bytes of full storage held now
        self.peak_live = 0  # the most `live` has been since construction (or reset_peak())
        self._world = world_group
        self.on_meta = None  # set by the first values taken
        self._shard_values(range(len(params)), layout.buckets)
        if self.shared_gather is not None:
            self._to_map |= self.shared_gather.mappable
        self.reset_peak()

    def _empty_of(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._empty:
            self._empty[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return self._empty[dtype]

    def _add_buckets(self, buckets, dtype: torch.dtype) -> None:
        """Storage for `buckets` (of self.layout), of `dtype`: each parameter a view of its bucket's full
        storage, made while that storage exists; then the storage goes, so that not even construction holds
        the whole model."""
        for slot in self.layout.params[len(self.views):]:
            self.views.append(torch.empty(slot.shape, dtype=dtype, device=self.device) if not slot.numel else None)
            self._bucket_of_param.append([])
        for b in buckets:
            self._lo.append(b.chunk(self.rank)[0] - b.start)
            if self.aliased:  # Note [One rank holds the whole bucket]
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
                self._bucket_of_param[i].append(b.index)
            self._point(b.index, full, self._comm[-1])
            if not self.aliased:
                full.untyped_storage().resize_(0)
            self.state.append(FREE)
            self.owed.append(0)

    def _point(self, b: int, full: torch.Tensor, comm: torch.Tensor, views: list | None = None) -> None:
        """Bucket b's full storage is `full` (gathers write it through `comm`): its parameters' views are cut from
        it (while it has memory; or given), and a tensor in it is known as bucket b's (`_bucket_at`)."""
        if self.full[b] is not None:
            del self._bucket_of_storage[self.full[b].untyped_storage()._cdata]
        self.full[b], self._comm[b] = full, comm
        bucket = self.layout.buckets[b]
        for k, i in enumerate(self.bucket_params[b]):
            slot = self.layout.params[i]
            s = slot.offset - bucket.start
            self.views[i] = full[s:s + slot.numel].view(slot.shape) if views is None else views[k]
        self._bucket_of_storage[full.untyped_storage()._cdata] = b  # the shard's: _bucket_at
        self._in_place_seen = []

    def _install_maps(self) -> None:
        """Mappable buckets that are free take their mappings (Note [Stage-3 buckets mapped, not copied] in
        shared_shard.py): from the first pass on, their gathers copy nothing."""
        for b in sorted(self._to_map):
            if self.state[b] != FREE:
                continue
            self._to_map.discard(b)
            full = self.maps.get(b)
            if full is None:
                full = self.shared_gather.mapping(b)
                if full is None:
                    continue  # the kernel would not: copied, as smaller buckets are
                self.maps[b] = full
            self._mapped[b] = (self.full[b], self._comm[b], [self.views[i] for i in self.bucket_params[b]])
            self._point(b, full, full)

    def _unmap(self, b: int) -> None:
        """Bucket b (free) has its private storage again, until `_install_maps` (full_params writes into it)."""
        self._point(b, *self._mapped.pop(b))
        self._to_map.add(b)

    def _buckets_of(self, index: int) -> list:
        return self._bucket_of_param[index]

    # ------------------------------------------------------------ construction
    @torch.no_grad()
    def _shard_values(self, members: range, buckets) -> None:
        """Rank 0's values of `buckets` (as DDP broadcasts them); this rank keeps its chunk.

        Parameters on the meta device have no values yet: their buckets start
        freed and `materialize` fills them, bucket by bucket (Note [Meta-device
        models])."""
        params = [self.members[i] for i in members]
        on_meta = [p.is_meta for p in params]
        if any(on_meta) and not all(on_meta) or (params and self.on_meta is not None and on_meta[0] != self.on_meta):
            raise ValueError("stage 3 found some parameters on the meta device and others not: build the whole "
                             "model on the meta device (or none of it) before wrapping it")
        self.on_meta = bool(on_meta) and on_meta[0]
        if self.on_meta:  # a meta tensor cannot take real storage through .data; its contents can be swapped
            for p in params:
                torch.utils.swap_tensors(p, torch.nn.Parameter(self._empty_of(p.dtype), requires_grad=p.requires_grad))
        for i in members:
            if not self.layout.params[i].numel:  # in no bucket: it keeps a (empty) tensor of its own
                self.members[i].data = self.views[i]
        for b in buckets if not self.on_meta else ():
            self._allocate(b.index, views=False)
            self.full[b.index].zero_()  # padding
            for i in self.bucket_params[b.index]:
                self.views[i].copy_(self.members[i].detach())
            self._show(b.index)
            self._publish_full(b.index)

    def _publish_full(self, b: int) -> None:
        """Bucket b's full values become rank 0's everywhere; this rank keeps its chunk of them."""
        full, bucket = self.full[b], self.layout.buckets[b]
        if dist.get_world_size(self._world) > 1:
            dist.broadcast(full, dist.get_global_rank(self._world, 0), group=self._world)
        lo = self._lo[b]
        if not self.aliased:  # else the chunk is the bucket (Note [One rank holds the whole bucket])
            self.every_chunk[b].copy_(full[lo:lo + bucket.chunk_numel])
        self.reshard(b)

    # Note [Meta-device models]
    # -------------------------
    # `with torch.device("meta"): model = Big()` builds shapes without memory.
    # At stage 3 no rank ever holds the whole model: `materialize` walks the
    # modules in registration order (the order their constructors ran), gives a
    # module's own parameters real storage in their buckets, and runs its
    # reset_parameters() - the same calls, in the same order, as an eager
    # build, so a seeded meta model gets the eager model's values. Once every
    # parameter of a bucket has its value, rank 0's bucket is broadcast, each
    # rank keeps its chunk and the bucket is freed: at most the buckets of one
    # module are whole at a time. A parameter tied to an earlier one keeps the
    # earlier value (as tying after construction does). ShardedDDP's
    # param_init_fn(module), if given, replaces reset_parameters() (a model whose
    # own constructor re-initialises weights, as GPT-2's std 0.02, says so in it).
    # Parameters of modules without either start at zero (a warning names them):
    # load a checkpoint into them (shardopt.load_weights). Frozen parameters are
    # sharded like the rest (Note [Frozen parameters at stage 3]); buffers, and
    # parameters the store does not hold (integer ones), get real storage here and
    # ShardedDDP broadcasts rank 0's.
    @torch.no_grad()
    def materialize(self, model: torch.nn.Module, param_init_fn=None) -> None:
        index = {id(p): i for i, p in enumerate(self.members)}
        left = [len(members) for members in self.bucket_params]
        done: set[int] = set()
        zeroed = []
        for name, mod in model.named_modules():
            unsharded = False  # a buffer (or a parameter the store does not hold) was on the meta device
            for key, buf in list(mod._buffers.items()):
                if buf is not None and buf.is_meta:
                    mod._buffers[key] = torch.zeros_like(buf, device=self.device)
                    unsharded = True
            for key, p in list(mod._parameters.items()):
                if p is not None and p.is_meta and id(p) not in index:
                    torch.utils.swap_tensors(p, torch.nn.Parameter(torch.zeros_like(p, device=self.device),
                                                                   requires_grad=p.requires_grad))
                    unsharded = True
            mine = [index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index]
            fresh = [i for i in mine if i not in done]
            if not fresh and not unsharded:
                continue
            for b in {b for i in fresh for b in self._buckets_of(i)}:
                if self.state[b] == FREE:
                    self._allocate(b)
                    self.full[b].zero_()
            # Tied to a parameter an earlier module initialised: keep that value (in a scratch tensor if its
            # bucket is already published and freed).
            kept = {i: self.members[i].detach().clone() if self.state[self._buckets_of(i)[0]] == LIVE
                    else None for i in mine if i in done}
            for i, value in kept.items():
                if value is None:
                    self.members[i].data = torch.empty_like(self.views[i])
            reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)  # MHA
            if param_init_fn is not None:
                param_init_fn(mod)
            elif callable(reset):
                reset()
            else:
                zeroed += [f"{name}.{k}" if name else k for k, p in mod._parameters.items()
                           if p is not None and (id(p) not in index or index[id(p)] in fresh)]
            for i, value in kept.items():
                if value is None:
                    self.members[i].data = self._empty_of(self.views[i].dtype)
                else:
                    self.views[i].copy_(value)
            done.update(fresh)
            for i in fresh:
                for b in self._buckets_of(i):
                    left[b] -= 1
                    if left[b] == 0:
                        self._publish_full(b)
        for b, n in enumerate(left):
            if n and self.state[b] != FREE:
                self._publish_full(b)
        if zeroed:
            warnings.warn(f"stage 3 built these meta-device parameters as zeros (their modules have no "
                          f"reset_parameters()): {', '.join(zeroed[:8])}{' ...' if len(zeroed) > 8 else ''}; "
                          f"load a checkpoint to give them values", UserWarning, stacklevel=3)
        self.on_meta = False

    # ---------------------------------------------------------------- buckets
    # Note [One rank holds the whole bucket]
    # --------------------------------------
    # With one rank in the shard group (world size 1, or a mesh whose shard
    # dimension is 1) a bucket's chunk is the whole bucket: the gather was a copy
    # of the chunk into fresh storage, and the free gave that storage back, two
    # or three times per step (forward, backward, the seam), for memory the
    # rank holds anyway. Measured on the CPU at 200 blocks it was about 5 ms of a
    # step (benchmarks/results/2026-11-28-stage3-host-cost.md); on a GPU it is a
    # device copy plus an allocation per bucket per pass. So here a bucket's full
    # storage *is* its chunk (`aliased`): the parameters are views of the chunk
    # while gathered, a gather issues no collective and copies nothing, a free
    # only gives the parameters their empty placeholder back (the walk, the
    # states, the gather count and every hook are as with several ranks: the
    # schedule is the same code). Nothing is added to `live`: no memory beyond
    # the shard is held. What differs, and is handled where it shows: the
    # optimizer's buckets all lie in one storage (the shard), so a saved view
    # is told its bucket by offset (`_bucket_at`); full_params(writeback=False)
    # puts the chunks back on exit, as dropping a gathered copy did. One
    # difference is left: a write into a parameter inside a forward (under
    # no_grad) reaches the chunk here and so the training, as with DDP, where
    # with several ranks it is lost when the bucket is freed.
    def _allocate(self, b: int, views: bool = True) -> None:
        """Bucket b's full storage exists again (its contents undefined); with `views`, its parameters are
        its views (a gather sets them when it is waited for, so nothing reads a bucket half written)."""
        full = self.full[b]
        if not self.aliased and b not in self._mapped:  # Note [One rank holds the whole bucket]: no memory to add
            nbytes = full.numel() * full.element_size()
            full.untyped_storage().resize_(nbytes)
            self.live += nbytes
            self.peak_live = max(self.peak_live, self.live)
        self.state[b] = LIVE
        if views:
            self._show(b)

    def _show(self, b: int) -> None:
        for i in self.bucket_params[b]:
            self.members[i].data = self.views[i]

    def start_gather(self, b: int) -> None:
        """Starts gathering bucket b into freshly allocated storage."""
        self._allocate(b, views=False)
        self.handles[b] = self._launch_gather(b)
        self.state[b] = GATHERING
        self.num_gathers += 1

    def _launch_gather(self, b: int, out: torch.Tensor | None = None):
        """Starts every rank's chunk of bucket b into its full storage (through `_comm`; or into `out`): flat,
        or in two levels over ranks on several nodes (across the nodes into the node chunk, then inside the node)."""
        if self.aliased or b in self._mapped:
            return _NOTHING_TO_GATHER  # Note [One rank holds the whole bucket], or [Stage-3 buckets mapped, not copied]
        out = self._comm[b] if out is None else out
        if self._in_shared(b):  # Note [Stage 3's gathers through shared memory]: copied when waited for
            return self.shared_gather.start_gather(b, out)
        if self.nodes is not None:
            return comm.start_two_level_all_gather(self.every_chunk[b], out, self.node_group,
                                                   self.across_group, impl=self.impl)
        return comm.start_all_gather(self.every_chunk[b], out, group=self.group, impl=self.impl)

    def _in_shared(self, b: int) -> bool:
        """Whether bucket b is gathered out of the shards in shared memory (not a collective)."""
        return self.shared_gather is not None and self.shared_gather.holds(b)

    def _end_reads(self) -> None:
        """A read phase of this rank is over (Note [Stage 3's gathers through shared memory])."""
        if self.shared_gather is not None:
            self.shared_gather.end_reads()

    def _sync(self) -> None:
        """A read phase that no pass agreement starts: after every peer's writes (a collective)."""
        if self.shared_gather is not None:
            self.shared_gather.sync()

    def wait(self) -> None:
        """Before this rank writes its shard (a step, a load): no peer still reads it."""
        if self.shared_gather is not None:
            self.shared_gather.wait_readers()

    def finish_gather(self, b: int) -> None:
        t0 = time.perf_counter()
        self.handles.pop(b).wait()
        self.phase["gather"] += time.perf_counter() - t0
        self.state[b] = LIVE
        self._show(b)

    def reshard(self, b: int, even_persistent: bool = False) -> None:
        kept = self.layout.buckets[b].persistent and not even_persistent
        if self.state[b] == GATHERING:
            if kept or not self._in_shared(b):
                self.finish_gather(b)  # never free memory a collective is still writing
            else:
                self.handles.pop(b).drop()  # nothing was copied yet, and no peer waits for this rank
        if self.state[b] == FREE or kept:
            return
        empty = self._empty_of(self.full[b].dtype)
        for i in self.bucket_params[b]:
            self.members[i].data = empty
        if not self.aliased and b not in self._mapped:  # [One rank holds the whole bucket]: the chunk stays
            self.full[b].untyped_storage().resize_(0)
            self.live -= self.full[b].numel() * self.full[b].element_size()
        self.state[b] = FREE

    def live_bytes(self) -> int:
        """Bytes of full parameters gathered now (persistent buckets included), in memory of this rank's own."""
        return self.live

    def mapped_bytes(self) -> int:
        """Bytes of the buckets gathered as mappings of every rank's shard (Note [Stage-3 buckets mapped, not
        copied] in shared_shard.py): no memory of their own, not in live_bytes()."""
        return sum(self.full[b].numel() * self.full[b].element_size() for b in self._mapped)

    def reset_peak(self) -> None:
        self.peak_live = self.live

    # ------------------------------------------------------------------ rounds
    def begin_forward(self) -> None:
        """The root module's forward starts: a forward round (Note [Stage-3 schedule])."""
        if self.round is not None:  # a pass that never ended (an exception): close it as every rank does
            self._close_round()
        if self._to_map:
            self._install_maps()
        self._start(Intent.FORWARD if torch.is_grad_enabled() else Intent.LOOK)
        self.round = self._new_round(Pass.FORWARD, self.schedule.forward)
        self.round.serves = self._serving()
        self.round.training = torch.is_grad_enabled()

    def _serving(self) -> bool:
        """Whether forwards end with `_serve` (Note [A module called again]): with several ranks, and only where
        a forward frees buckets (reshard_after_forward=False frees nothing before the backward)."""
        return self.agree_group is not None and self.reshard_after_forward

    def _start(self, intent: Intent) -> None:
        """Every rank starts the same pass: a rank whose peers start a forward without gradients walks its
        gathers with them first (Note [Passes every rank agrees on] in passes.py)."""
        if intent is Intent.STEP and self.last_intent is Intent.STEP:
            return  # the step's rounds were settled already (clip_grad_norm, then step)
        self.last_intent = intent
        self.passes_started += 1
        if self.agree_group is None or (self.join_agree is not None and self.join_agree(intent)):
            return
        while True:
            everyone = exchange(intent, self.passes_started, self.agree_group, self.agree_shm)
            if any(p is Intent.AGAIN for p, _ in everyone):  # a peer's forward ends here: out of step (a bug)
                ranks = [dist.get_global_rank(self.agree_group, r) for r in range(len(everyone))]
                raise RuntimeError(describe(everyone, ranks))
            if intent is Intent.LOOK or all(p is intent for p, _ in everyone):
                return  # a forward without gradients goes ahead: the others shadow it
            if any(p is Intent.LOOK for p, _ in everyone):
                self.shadow_look()
                continue
            ranks = [dist.get_global_rank(self.agree_group, r) for r in range(len(everyone))]
            raise RuntimeError(describe(everyone, ranks))

    def shadow_look(self) -> None:
        """The gathers of another rank's forward without gradients, each bucket freed as it arrives."""
        for b in self.schedule.forward:
            if self.state[b] == FREE:
                self.start_gather(b)
                self.reshard(b)
        if self._serving():  # the LOOK ends by serving what it asks for again (Note [A module called again])
            self._serve(-1)
        self._end_reads()

    def _new_round(self, kind: Pass, order: tuple) -> _Round:
        return _Round(kind, order, self.schedule.users, frozenset(b for b in order if self.state[b] != FREE))

    def end_forward(self, grad_enabled: bool) -> None:
        """The root module's forward returned (or raised): the rest of the round, then frees.

        With reshard_after_forward=False a forward whose backward will follow keeps
        everything gathered for it (its backward round gathers nothing); with True it
        keeps the buckets that backward needs first (Note [The seam between forward
        and backward])."""
        if self.round is None or self.round.kind is not Pass.FORWARD:
            return
        keep_all = grad_enabled and not self.reshard_after_forward
        seam = self._seam if grad_enabled else ()
        if keep_all:
            self._finish_round_gathers()
        else:
            self._drain_round(keep=seam)
        if self.round.serves:  # the gathers peers ask for again, until every rank's forward has ended
            self._serve(-1)
        for b in range(len(self.full)):
            if keep_all or b in seam:
                if self.state[b] == GATHERING:
                    self.finish_gather(b)
            else:
                self.reshard(b)
        self.round = None
        self._end_reads()
        self.backwards_owed += int(grad_enabled)

    def _begin_backward(self) -> None:
        # No agreement here (Note [Passes every rank agrees on]): a rank whose backward reached none of the
        # store's buckets walks this round in settle(), after collectives its peers' backward runs first.
        order = self.schedule.backward if self.reshard_after_forward else ()
        self.round = self._new_round(Pass.BACKWARD, order)
        pending = [-1] * len(self.full)  # per bucket: parameters still without a gradient (-1: not counted)
        for b in order:
            if b < self.trainable_buckets:
                pending[b] = len(self.bucket_params[b])
        if self.grad_hooks is not None:
            self.grad_hooks.arm(pending)  # Note [Stage 3's gradient hooks in C++] in csrc/comm/grad_hooks.h
        if torch._C._current_graph_task_id() != -1:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """The backward pass is over (autograd's final callback): the rest of the round, then frees."""
        if self.round is not None and self.round.kind is Pass.BACKWARD:
            self._close_round()
            self.backwards_owed = max(0, self.backwards_owed - 1)
        if self.grad_hooks is not None and self.grad_hooks.ensure():
            # Python's first p.register_hook on a parameter clears its tensor hooks, ours with them (Note
            # [Stage 3's gradient hooks in C++]); put back after each forward, they were missing in this
            # backward only if a hook was registered between its forward and it: gradients went astray.
            raise RuntimeError("stage 3: a gradient hook was registered on a parameter (p.register_hook) after "
                               "the forward and before this backward, which removed shardopt's own hook from "
                               "it, so this backward's gradients were not all reduced; register parameter "
                               "hooks before the forward (or before wrapping) and restart from the last "
                               "checkpoint")

    def settle(self) -> None:
        """Before a step: backward rounds this rank owes (grad-enabled forwards whose backward reached none
        of its parameters, while other ranks' did), so every rank has walked the same rounds."""
        while self.backwards_owed:
            self._begin_backward()
            self.end_backward()

    def catch_up(self) -> None:
        """Every rank calls it at the same point of its program: a rank that ran fewer forwards without gradients
        than a peer walks the peer's extra gathers here (Note [Models sharded for inference] in inference.py)."""
        self.last_intent = None  # never skipped, as a second step() after clip_grad_norm() is
        self._start(Intent.SYNC)

    def start_step(self) -> None:
        # Once this rank has joined its peers' backward reductions, not in settle(): a rank whose backward
        # reached none of the store's buckets joins them from its step, after settle(), and a peer waiting
        # there would wait for an agreement this rank has not reached (Note [Passes every rank agrees on]).
        self._start(Intent.STEP)

    def _close_round(self) -> None:
        if self.grad_hooks is not None and self.round.kind is Pass.BACKWARD:
            self.grad_hooks.disarm()
        self._drain_round()
        for b in range(len(self.full)):
            self.reshard(b)
        if self.round.kind is Pass.BACKWARD:
            self._forget_owed()
        self.round = None
        self._end_reads()

    def _drain_round(self, keep=()) -> None:
        """The round's gathers no module asked for (a skipped module's, a frozen layer's that no backward
        reaches), each freed once it arrives unless in `keep`: at most one such bucket at a time, not the
        rest of the model at once."""
        r = self.round
        while r.pos < len(r.order):
            b = r.order[r.pos]
            was_free = self.state[b] == FREE
            self._issue_position()
            if was_free and b not in keep:
                self.reshard(b)

    def _finish_round_gathers(self) -> None:
        r = self.round
        while r.pos < len(r.order):
            self._issue_position()

    def _advance(self, until: int | None) -> None:
        """Issues the round's gathers up to position `until` (inclusive), then prefetches: up to `prefetch`
        positions past the furthest one asked for, while there is room."""
        r = self.round
        if until is not None:
            r.needed = max(r.needed, until)
            while r.pos <= until:
                self._issue_position()
        while r.pos < len(r.order) and r.pos <= r.needed + self.prefetch and self._room():
            self._issue_position()

    def _issue_position(self) -> None:
        r = self.round
        b = r.order[r.pos]
        r.pos += 1
        if self.state[b] == FREE and b not in r.carried:
            self.start_gather(b)

    def _room(self) -> bool:
        if self.max_live is None:
            return True
        live = sum(1 for b, s in enumerate(self.state) if s != FREE and not self.layout.buckets[b].persistent)
        return live < self.max_live

    # Note [A module called again]
    # ---------------------------
    # Within one pass a module may run as often as the data says, differently
    # on every rank: adaptive depth (a block called 1-3 times), recurrent
    # refinement, an MoE layer running an expert once per token group routed
    # to it. Every rank still walks the whole round; what differs is buckets
    # needed again after the walk has passed them. Two rules serve them.
    #   Kept for their scope. In forward, a bucket whose waiting modules have
    #   all returned is not freed at once: it is `spent`, with a scope (the
    #   module's own buckets; for a layer of an nn.Sequential below the root, a
    #   block built as a Sequential, the Sequential's buckets if at most
    #   reuse_limit() = 1 + prefetch of them are not the root's own, which it
    #   holds for the whole pass anyway: schedule.plan_reuse_scopes). It is
    #   freed when a module starts that needs a bucket outside that scope, or
    #   when the forward ends. Releases are local, so this changes no
    #   collective, and a module called again at once (`for _ in range(k):
    #   x = block(x)`, one expert for consecutive token groups) finds its
    #   buckets gathered: no gather, no exchange. Memory: spent buckets go
    #   before the next module's walk gathers or prefetches anything, so the
    #   most held at once grows only while a Sequential block's later layers
    #   run, by its earlier layers' buckets (at most reuse_limit()).
    #   Asked again. A module that needs a bucket after it was freed (A, B, A:
    #   an expert again after another one) has no local answer, and a gather
    #   of its own would pair with whatever collective each peer issues next
    #   (issue 56: gloo's "collective mismatch", or wrong values at equal
    #   sizes). So the rank first issues the rest of the round's gathers (every
    #   collective before is paired; each freed as it arrives, as at the
    #   forward's end, so the memory bound holds, unless it was gathered
    #   already or is the seam's: then the walk is at its end, and each bucket
    #   a later module needs is asked again too), then says which bucket it needs in an
    #   all-gather on the agreement group (passes.exchange: AGAIN, bucket), and
    #   every forward ends with the same exchange saying -1 (this forward has
    #   ended), repeated until no rank asks. Every rank reads the same outcome
    #   and gathers each bucket asked for, in rank order (kept by the ranks that
    #   asked; a rank holding it gathers into scratch memory). A rank whose
    #   forward ended first waits in its end exchange, before any collective
    #   of its backward, so the extra gathers pair rank by rank whatever each
    #   rank's data did. Forwards without gradients do the same, and so do the
    #   ranks that shadow them (shadow_look; a joined rank under Join shadows
    #   through end_forward and shadow_look).
    # The cost: one all-gather of two integers per forward with several ranks
    # and reshard_after_forward=True; none with False, where nothing a forward
    # gathered is freed before its backward. Backward needs neither rule: it
    # frees a bucket only once all of its parameters have their gradient, and
    # autograd accumulates a parameter used k times once, after all k uses
    # (a checkpointed call recomputes inside that backward and finds the bucket
    # gathered). A round that began without the root's forward (a submodule
    # called on its own) does not end with the exchange: there a bucket needed
    # again takes a gather of this rank's alone, as before. An AGAIN exchange
    # that meets a pass agreement (ranks out of step) raises on every rank,
    # naming what each was doing, instead of pairing different collectives.
    # Note [A module whose buckets are gathered]
    # -----------------------------------------
    # need() runs for every module that waits (twice per block of a stack: the
    # block and its Linear, which the block's wait covers) and for every weight
    # a backward unpacks. Most calls find every bucket gathered and the walk
    # already past them and their prefetch: then the full walk below changes
    # nothing (no position to raise, no gather to issue), and the fast path
    # returns after reading the states and positions alone. It answers only
    # when the walk would have done nothing, so the schedule every rank walks
    # is the same gather for gather (the gather count per step is unchanged,
    # tests/test_stage3.py).
    def need(self, buckets) -> None:
        """A module is about to use these buckets (its forward, or a saved weight in backward)."""
        r = self.round
        if r is not None and r.spent:  # Note [A module called again]: a module of another bucket frees them
            self._spend(r, buckets)
        if r is not None:  # Note [A module whose buckets are gathered]
            state, position, needed = self.state, r.position, r.needed
            for b in buckets:
                if state[b] is not LIVE:
                    break
                at = position.get(b, -1)
                if at > needed:
                    break
            else:
                if r.pos >= len(r.order) or r.pos > needed + self.prefetch:
                    return
        in_backward = torch._C._current_graph_task_id() != -1
        if self.round is None:
            if in_backward:
                self._begin_backward()
            else:  # a submodule called on its own, outside the root's forward
                self._start(Intent.FORWARD if torch.is_grad_enabled() else Intent.LOOK)
                self.round = self._new_round(Pass.FORWARD, self.schedule.forward)
        r = self.round
        for b in buckets:
            if self.state[b] != FREE:
                r.needed = max(r.needed, r.position.get(b, -1))
            if self.state[b] == LIVE:
                continue
            if self.state[b] == FREE:
                at = r.position.get(b, -1)
                if at < r.pos or b in r.carried:
                    # Needed again after it was freed in this pass: the rest of the round first, then one
                    # extra gather, which every rank joins (Note [A module called again]).
                    if r.serves:
                        self._drain_round(keep=self._seam if r.training else ())
                        self._serve(b)
                    else:
                        self._finish_round_gathers()
                        self.start_gather(b)
                else:
                    self._advance(at)
            if self.state[b] == GATHERING:
                self.finish_gather(b)
        self._advance(None)

    def _spend(self, r: _Round, buckets) -> None:
        """A module starts: a bucket kept after its modules returned stays while the module needs only buckets
        of the kept one's scope (the module again, or its block), and goes otherwise (Note [A module called
        again])."""
        spent = r.spent
        for b, scope in list(spent.items()):
            if not all(x in scope for x in buckets):
                del spent[b]
                self.reshard(b)

    def reuse_limit(self) -> int:
        """The most buckets a scope of Note [A module called again] may keep: as many as a module's wait and
        its prefetch gather (the seam's depth)."""
        return 1 + self.prefetch if self.max_live is None else max(1, min(1 + self.prefetch, self.max_live))

    def _serve(self, want: int) -> None:
        """Asks every rank for bucket `want` again (or, -1, says this rank's forward has ended) and gathers
        every bucket some rank asks for, in rank order; with -1, until no rank asks (Note [A module called
        again])."""
        while True:
            everyone = exchange(Intent.AGAIN, want, self.agree_group, self.agree_shm)
            if any(p is not Intent.AGAIN for p, _ in everyone):
                if self.round is not None:
                    self.round.serves = False  # the forward's end (its hook runs on the way out) asks no more
                ranks = [dist.get_global_rank(self.agree_group, r) for r in range(len(everyone))]
                raise RuntimeError(describe(everyone, ranks))
            asked = list(dict.fromkeys(b for _, b in everyone if b >= 0))
            if not asked:
                return
            self.num_again += len(asked)
            for b in asked:
                self._gather_again(b, keep=b == want)
            if want >= 0:
                return

    def _gather_again(self, b: int, keep: bool) -> None:
        """Bucket b's gather that some rank asked for again; this rank keeps it only if it asked."""
        if self.state[b] == FREE:
            self.start_gather(b)
            if keep:
                self.finish_gather(b)
            else:
                self.reshard(b)  # a collective's gather is finished first; one through shared memory copies nothing
            return
        if self.state[b] == GATHERING:
            self.finish_gather(b)
        if self._in_shared(b):  # no peer waits for this rank's part (Note [Stage 3's gathers through shared memory])
            self.num_gathers += 1
            return
        # Live here (this rank's own use, the seam), but the collective needs this rank's chunk: gathered into
        # scratch memory, not over the values its modules may be reading.
        scratch = torch.empty(self.layout.buckets[b].numel, dtype=self.full[b].dtype, device=self.device)
        self._launch_gather(b, scratch).wait()
        self.num_gathers += 1

    def forward_done(self, module_id: int, buckets, scope: frozenset | None = None) -> None:
        """A module's forward returned: buckets every waiting module has now used may go."""
        r = self.round
        if r is None or r.kind is not Pass.FORWARD:
            return
        if module_id not in r.ran:  # a module called again counts once
            r.ran.add(module_id)
            for b in buckets:
                r.users[b] -= 1
        if not self.reshard_after_forward:
            return
        # The seam of a training forward, even where a module returns under no_grad inside it (end_forward keeps
        # the seam by the grad mode at the root's return, as a forward's start has it).
        seam = self._seam if r.training or torch.is_grad_enabled() else ()
        scope = frozenset(buckets) if scope is None else scope
        for b in buckets:  # kept until a module outside its scope starts (Note [A module called again])
            if r.users[b] <= 0 and b not in seam and self.state[b] != FREE:
                r.spent[b] = scope

    def bucket_grads_done(self, b: int) -> None:
        """Every parameter of bucket b has its gradient of this backward (the C++ hooks' count): it may go."""
        r = self.round
        if r is not None and r.kind is Pass.BACKWARD:
            self.reshard(b)

    # ------------------------------------------------------------- attaching
    # Note [The seam between forward and backward]
    # ---------------------------------------------
    # With reshard_after_forward the forward frees a bucket once its modules have
    # returned, and the backward gathers it again. The buckets the backward round
    # starts with (the root's own layers and the last block: the first entries
    # of schedule.backward, as many as the backward's first wait plus its
    # prefetch would gather) are the last the forward used, and nothing runs
    # between the two passes that could hide their gather: freeing them only to
    # wait for them again at once costs a whole exposed gather per step and
    # saves no peak memory (the backward holds them right away). So a forward
    # whose backward will follow keeps them (FSDP2 likewise does not reshard the
    # root after forward); a no-grad forward (evaluation) frees everything.
    def attach(self, engine, waits) -> None:
        self.engine = engine
        self.schedule = plan_stage3_schedule(self.layout, waits)
        depth = 1 + self.prefetch if self.max_live is None else min(1 + self.prefetch, self.max_live)
        self._seam = frozenset(self.schedule.backward[:depth])

    def adopt(self, module: torch.nn.Module, param_init_fn=None) -> bool:
        hooks.forget_orphan(module)  # a module whose last wrapper was dropped (Note [Orphaned stage-3 modules])
        self._take_frozen(module)    # Note [Frozen parameters at stage 3]
        if not self.on_meta:
            return False
        self.materialize(module, param_init_fn)  # Note [Meta-device models]
        return True

    # Note [Frozen parameters at stage 3]
    # -----------------------------------
    # A frozen parameter (requires_grad=False: a LoRA model's base, a frozen encoder) is most of the model
    # exactly when the model does not fit, so stage 3 shards it like the trainable ones: the first
    # ShardedDDP to take the module plans buckets for the frozen floating-point parameters it finds (one
    # region per dtype, the same bucket size and persistence threshold) and appends them after the
    # optimizer's buckets (layout.append_layout): the optimizer's layout, chunks, gradients and state
    # are unchanged, and a frozen bucket has a chunk of the model's values here and nothing else (no
    # gradient, no master, no optimizer state: 2 or 4 bytes x P/N at rest). The schedule walks them with
    # the rest, so a forward gathers and frees them as it does trainable buckets. Backward is where they
    # differ: a trainable bucket is freed once its parameters have their gradients, and a frozen one
    # never gets any. So in a forward that will be differentiated, each module that waits for frozen
    # buckets passes its inputs that need a gradient through `_AfterBackward`, an identity whose
    # backward runs once the module's own backward has produced its input gradients - after the
    # module's last read of its saved weights - and frees those buckets once every such call of the
    # forward has come back (`owed`). A bucket that a module used with no input needing a gradient (the
    # first layers of a model whose trainable adapters come later) is `held` and freed when the backward
    # ends, as is whatever the walk gathered that no backward asked for (`_drain_round`, one at a time).
    def _take_frozen(self, module: torch.nn.Module) -> None:
        held = {id(p) for p in self.members}
        frozen: dict = {}  # dtype -> [(name, parameter)], each parameter once (tied ones under their first name)
        for name, p in module.named_parameters():
            if id(p) not in held and not p.requires_grad and p.is_floating_point():
                frozen.setdefault(p.dtype, []).append((name, p))
        if not frozen:
            return
        first_param, first_bucket = len(self.members), len(self.full)
        for dtype, named in frozen.items():
            start = len(self.layout.params)
            part = plan_layout([[(name, tuple(p.shape)) for name, p in named]], self.layout.world_size,
                               self.layout.bucket_numel, self.layout.bucket_numel, whole_params=True,
                               persistent=frozenset(i for i, (_, p) in enumerate(named)
                                                    if p.numel() <= self.persistence_threshold),
                               nodes=self.layout.nodes,  # whole pages: Note [Stage-3 buckets mapped, not copied]
                               page_numel=page_numel(dtype.itemsize) if self.shared_gather is not None else 0)
            self.layout = append_layout(self.layout, part)
            self.members += [p for _, p in named]
            new = self.layout.buckets[len(self.full):]
            chunks = None
            if self.shared_gather is not None:  # Note [Stage 3's gathers through shared memory]
                chunks = open_frozen_region(self.shared_gather, new, dtype, self.agree_group)
            for k, b in enumerate(new):
                chunk = chunks[k] if chunks is not None else torch.empty(b.chunk_numel, dtype=dtype, device=self.device)
                self.every_chunk.append(chunk)
                self.frozen_shard_bytes += chunk.numel() * chunk.element_size()
            self._add_buckets(new, dtype)
            assert len(self.layout.params) == start + len(named)
        self._shard_values(range(first_param, len(self.members)), self.layout.buckets[first_bucket:])
        if self.shared_gather is not None:
            self._to_map |= self.shared_gather.mappable - set(self.maps)

    def frozen_bucket(self, b: int) -> bool:
        return b >= self.trainable_buckets

    def after_backward(self, buckets: tuple, args: tuple, kwargs: dict):
        """A module's forward pre-hook, in a forward that will be differentiated: its inputs that need a
        gradient pass through _AfterBackward, which frees `buckets` (frozen) once the module's backward is
        done (Note [Frozen parameters at stage 3]). Returns the new (args, kwargs), or None if no input
        needs a gradient (the buckets are then held until the backward ends)."""
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        at = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            self.held.update(buckets)
            return None
        outs = _AfterBackward.apply(self, buckets, *(leaves[k] for k in at))
        for k, out in zip(at, outs):
            leaves[k] = out
        for b in buckets:
            self.owed[b] += 1
        return torch.utils._pytree.tree_unflatten(leaves, spec)

    def backward_done(self, buckets: tuple) -> None:
        for b in buckets:
            self.owed[b] -= 1
            if self.owed[b] <= 0 and b not in self.held and self.round is not None \
                    and self.round.kind is Pass.BACKWARD:
                self.reshard(b)

    def _forget_owed(self) -> None:
        self.owed = [0] * len(self.owed)
        self.held.clear()

    def forward_waits(self, module, index, layout) -> list:
        return plan_forward_waits(module, {id(p): i for i, p in enumerate(self.members)}, self.layout)

    def install_hooks(self, wrapper_ref, module, optimizer, waits) -> list:
        return hooks.install(self, wrapper_ref, module, optimizer, waits)

    def released(self, module: torch.nn.Module, orphaned: bool) -> None:
        if orphaned:
            hooks.refuse_orphan(module)

    def whole_copies(self) -> list:
        with self.gathered(writeback=False), torch.no_grad():
            copies = [p.detach().clone() for p in self.members]
        trainable = len(self.params)
        for p, value in zip(self.members[trainable:], copies[trainable:]):
            p.data = value  # frozen parameters keep their whole value too (ShardedDDP.detach sets the others)
        return copies[:trainable]

    def publish(self, defer: bool) -> None:
        self.refresh_persistent()  # the next forward gathers the rest as it uses them

    def moved(self, index: int) -> bool:
        return not self.in_place(index)

    def resting_shape(self, index: int) -> tuple:
        slot = self.layout.params[index]
        whole = not slot.numel or self.layout.buckets[self._bucket_of_param[index][0]].persistent
        return tuple(slot.shape) if whole else (0,)

    def param_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size() + self.frozen_shard_bytes + self.live

    def _bucket_at(self, t: torch.Tensor) -> int | None:
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
            b = self._bucket_at(t)
        except (RuntimeError, NotImplementedError):
            return t
        if b is None or self.layout.buckets[b].persistent:
            return t
        return (b, t)  # Note [Parameters between gathers]: valid again once bucket b is gathered

    def unpack(self, saved):
        if not isinstance(saved, tuple):
            return saved
        b, t = saved
        self.need((b,))
        return t

    # ------------------------------------------------------------- whole weights
    @contextlib.contextmanager
    def gathered(self, writeback: bool = True):
        """Every bucket gathered (a collective: every rank enters); on exit this rank's chunk takes what
        the full parameters hold (writeback) and the buckets gathered for it are freed."""
        if self.round is not None:
            raise RuntimeError("full_params() inside a forward or backward pass: use it between steps")
        # Written into, so copies: the mapped buckets take their private storage back for it (Note [Stage-3
        # buckets mapped, not copied] in shared_shard.py), and their mappings after.
        shown = [b for b in self._mapped if self.state[b] != FREE]
        for b in shown:
            self.reshard(b)
        for b in list(self._mapped):
            self._unmap(b)
        was_free = [b for b, s in enumerate(self.state) if s == FREE]
        self._sync()  # Note [Stage 3's gathers through shared memory]: after the peers' writes
        for b in was_free:
            self.start_gather(b)
        for b in was_free:
            self.finish_gather(b)
        # One rank alone writes into its chunks themselves (Note [One rank holds the whole bucket]): without
        # writeback they take back what they held, as a gathered copy would have been dropped.
        before = [c.clone() for c in self.every_chunk] if self.aliased and not writeback else None
        try:
            yield
        finally:
            if writeback:
                self._sync()  # every peer has read this rank's chunk before it is written
                self.take_chunks()
            elif before is not None:
                with torch.no_grad():
                    for c, v in zip(self.every_chunk, before):
                        c.copy_(v)
            for b in was_free:
                self.reshard(b)
            self._install_maps()
            for b in shown:
                self._allocate(b)
            if not writeback:
                self._end_reads()

    def stream(self, indices):
        by_bucket: dict = {}
        for i in indices:
            if self.layout.params[i].numel:
                by_bucket.setdefault(self._bucket_of_param[i][0], []).append(i)
            else:
                yield i, self.views[i]
        if by_bucket and self.round is not None:
            raise RuntimeError("weights streamed inside a forward or backward pass: do it between steps")
        if by_bucket:
            self._sync()  # Note [Stage 3's gathers through shared memory]: after the peers' writes
        try:
            yield from self._stream_buckets(by_bucket)
        finally:
            if by_bucket:
                self._end_reads()

    def _stream_buckets(self, by_bucket: dict):
        for b in sorted(by_bucket):
            was_free = self.state[b] == FREE
            if was_free:
                self.start_gather(b)
            if self.state[b] == GATHERING:
                self.finish_gather(b)
            try:
                for i in by_bucket[b]:
                    # A copy: a consumer that hands the bytes to numpy (a file writer) pins their storage, and
                    # the bucket's must be freed again.
                    yield i, self.views[i].clone()
            finally:
                if was_free:
                    self.reshard(b)

    def after_load(self) -> None:
        self.refresh_persistent(frozen=True)  # a frozen persistent bucket's chunks were written too

    @torch.no_grad()
    def take_chunks(self) -> None:
        """This rank's chunk of every gathered bucket from the full parameters (after they were written)."""
        for b in self.layout.buckets:
            if self.state[b.index] == LIVE and not self.aliased:  # aliased: written in place already
                lo = self._lo[b.index]
                self.every_chunk[b.index].copy_(self.full[b.index][lo:lo + b.chunk_numel])

    def refresh_persistent(self, frozen: bool = False) -> None:
        """After a step: the persistent buckets take every rank's updated chunk (as stage 2 publishes); the
        frozen ones only after a load (a step does not change them)."""
        upto = len(self.full) if frozen else self.trainable_buckets
        keep = [b.index for b in self.layout.buckets[:upto] if b.persistent]
        if not keep:
            return
        self._sync()  # after every rank wrote its chunks (Note [Stage 3's gathers through shared memory])
        for b in keep:
            self.handles[b] = self._launch_gather(b)
            self.state[b] = GATHERING
            self.num_gathers += 1
        for b in keep:
            self.finish_gather(b)
        self._end_reads()

    # ----------------------------------------------------------------- checks
    # Note [Parameters in place, checked in C]
    # ----------------------------------------
    # check_params_in_place runs before every forward and every step (Note
    # [Parameters stay in the flat buffer] in optimizer.py). Asked parameter by
    # parameter (in_place below) it was 2 Python calls per parameter per step:
    # at 400 parameters about 3 ms of a 20-60 ms host-bound step (cProfile,
    # benchmarks/results/2026-11-28-stage3-host-cost.md). Whether a parameter is
    # in place depends only on what it points at: its storage (the StorageImpl,
    # whose address `_cdata` stays the same while a bucket is freed and gathered
    # again, as resize_ keeps the object), its offset and shape in it, and its
    # dtype; the views and the empty placeholder it is compared with never
    # change. So all_in_place reads those four for every parameter with C
    # loops (map over the tensors) and compares them with the last set that
    # in_place accepted one by one: equal, every parameter is in place; not
    # equal (a bucket in another state, or a parameter moved), the caller asks
    # in_place per parameter, and a set found all in place is remembered. A few
    # such sets are kept (between steps every non-persistent bucket is free;
    # reshard_after_forward=False and the seam give others).
    def all_in_place(self) -> bool:
        params = self.params
        key = (list(map(_STORAGE_CDATA, map(torch.Tensor.untyped_storage, params))),
               list(map(torch.Tensor.storage_offset, params)), list(map(_SHAPE, params)), list(map(_DTYPE, params)))
        if key in self._in_place_seen:
            return True
        if not all(map(self.in_place, range(len(params)))):
            return False
        self._in_place_seen = [key] + self._in_place_seen[:3]
        return True

    def in_place(self, index: int) -> bool:
        """Whether parameter `index` still holds what this shard put there (its bucket view, or the empty
        tensor while freed): Note [Parameters stay in the flat buffer] in optimizer.py, at stage 3."""
        p, view = self.params[index], self.views[index]
        if p.dtype != self.dtype:
            return False
        if p.numel() == 0 and view.numel():  # freed: the shared empty tensor, not an empty one of its own
            return p.untyped_storage()._cdata == self._empty_storage
        return p.data_ptr() == view.data_ptr() and p.shape == view.shape
