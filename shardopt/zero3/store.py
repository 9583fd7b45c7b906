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
(x @ W saves W); saved views of a bucket are packed as (bucket, size, stride,
offset) and unpacked by asking for the bucket again, which is what moves the
backward round forward (a weight backward never reads: Note [Gradients of
parameters not gathered]). Gathers write through a second tensor on the same
storage (`_comm`), so autograd's version counter of the parameters' views is
not bumped by the collective that refills them.

Note [Gradients of parameters not gathered]
-------------------------------------------
Some weights are never read in backward: an embedding's (its backward needs
the indices only), a first Linear's on an input without grad (grad_W needs
the input, not W). Its bucket may then be free (or still gathering) when
autograd accumulates the gradient, and autograd's AccumulateGrad checks the
new gradient's layout against the parameter's sizes and strides: against an
empty placeholder a 2-d gradient fails ("The size of tensor a (0) must match
the size of tensor b (64)"). Gathering the bucket only for that check would
cost a collective and the memory of, say, a vocabulary embedding, for
nothing. Instead the parameter gets a stand-in of its shape that holds one
element (a zero-stride expansion) just before the accumulation (ShardedDDP's
pre-hook), which autograd accepts without copying, and the placeholder back
once the gradient is handed on (`grad_ready`), unless the bucket was
gathered meanwhile.
"""
from __future__ import annotations

import contextlib
import enum
import time
import warnings

import torch
import torch.distributed as dist

from shardopt.layout import Layout, plan_layout
from shardopt.param_store import ParamStore
from shardopt.parallel import comm
from shardopt.parallel.mesh import copy_group, two_level_groups
from shardopt.zero3 import hooks
from shardopt.zero3.schedule import Stage3Schedule, plan_stage3_schedule


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
        self.pending: dict[int, int] = {}  # backward: parameters still without a gradient, per bucket


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
        return plan_layout(names, world_size, *sizes, replicas=replicas, whole_params=True, persistent=persistent,
                           nodes=nodes)

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
        self.dtype, self.device = params[0].dtype, device
        self.flat_grad, self.resting_grads = None, [None] * len(params)  # gradients: only this rank's chunks
        self.engine = None
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
        # Where this rank's chunk lies inside each bucket (Bucket.chunk knows the node-aware order).
        self._lo = [b.chunk(rank)[0] - b.start for b in layout.buckets]
        offsets = layout.chunk_offsets()
        self.shard = torch.empty(layout.shard_numel(), dtype=self.dtype, device=self.device)
        self.chunks = [self.shard[offsets[b.index]:offsets[b.index] + b.chunk_numel] for b in layout.buckets]
        # Full storage of every bucket, allocated only while gathered: empty from the start, so that not
        # even construction holds the whole model.
        self.views: list = [torch.empty(s.shape, dtype=self.dtype, device=self.device) if not s.numel else None
                            for s in layout.params]
        self.bucket_params: list[list[int]] = [[] for _ in layout.buckets]
        self._bucket_of_param: list[list[int]] = [[] for _ in params]  # whole parameters: one bucket each
        self.full, self._comm = [], []
        for b in layout.buckets:  # one at a time: the views are made, then the storage goes
            full = torch.empty(b.numel, dtype=self.dtype, device=self.device)
            self.full.append(full)
            self._comm.append(torch.empty(0, dtype=self.dtype, device=self.device).set_(
                full.untyped_storage(), 0, (b.numel,)))
            self._views_of(b)
            full.untyped_storage().resize_(0)
        self._bucket_of_storage = {f.untyped_storage()._cdata: b for b, f in enumerate(self.full)}
        self.placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        self._empty_storage = self.placeholder.untyped_storage()._cdata
        self.state = [FREE] * len(layout.buckets)
        self.handles: dict[int, object] = {}
        self.schedule: Stage3Schedule | None = None  # set when ShardedDDP attaches (it knows the modules)
        self._seam: frozenset = frozenset()  # Note [The seam between forward and backward]
        self.round: _Round | None = None
        self.backwards_owed = 0  # grad-enabled forwards whose backward round has not run on this rank
        self.num_gathers = 0
        self.live = 0  # bytes of full storage held now
        self.peak_live = 0  # the most `live` has been since construction (or reset_peak())
        self._shard_from_params(world_group)
        self.reset_peak()

    def _views_of(self, bucket) -> None:
        """Every parameter of `bucket` as a view of its full storage (made while that storage exists)."""
        full = self.full[bucket.index]
        for i in bucket.params:
            slot = self.layout.params[i]
            s = slot.offset - bucket.start
            self.views[i] = full[s:s + slot.numel].view(slot.shape)
            self.bucket_params[bucket.index].append(i)
            self._bucket_of_param[i].append(bucket.index)

    def _buckets_of(self, index: int) -> list:
        return self._bucket_of_param[index]

    # ------------------------------------------------------------ construction
    @torch.no_grad()
    def _shard_from_params(self, world_group) -> None:
        """Rank 0's values of every bucket (as DDP broadcasts them); this rank keeps its chunk.

        Parameters on the meta device have no values yet: every bucket starts
        freed and `materialize` fills them, bucket by bucket (Note [Meta-device
        models])."""
        self._world = world_group
        self.on_meta = any(p.is_meta for p in self.params)
        if self.on_meta:  # a meta tensor cannot take real storage through .data; its contents can be swapped
            for i, p in enumerate(self.params):
                torch.utils.swap_tensors(p, torch.nn.Parameter(self.placeholder, requires_grad=p.requires_grad))
        for slot in self.layout.params:
            if not slot.numel:  # in no bucket: it keeps a (empty) tensor of its own
                self.params[slot.index].data = self.views[slot.index]
        for b in self.layout.buckets if not self.on_meta else ():
            self._allocate(b.index, views=False)
            self.full[b.index].zero_()  # padding
            for i in self.bucket_params[b.index]:
                self.views[i].copy_(self.params[i].detach())
            self._show(b.index)
            self._publish_full(b.index)

    def _publish_full(self, b: int) -> None:
        """Bucket b's full values become rank 0's everywhere; this rank keeps its chunk of them."""
        full, bucket = self.full[b], self.layout.buckets[b]
        if dist.get_world_size(self._world) > 1:
            dist.broadcast(full, dist.get_global_rank(self._world, 0), group=self._world)
        lo = self._lo[b]
        self.chunks[b].copy_(full[lo:lo + bucket.chunk_numel])
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
    # load a checkpoint into them. Frozen parameters and buffers are not sharded:
    # they get real storage here and ShardedDDP broadcasts rank 0's.
    @torch.no_grad()
    def materialize(self, model: torch.nn.Module, param_init_fn=None) -> None:
        index = {id(p): i for i, p in enumerate(self.params)}
        left = [len(members) for members in self.bucket_params]
        done: set[int] = set()
        zeroed = []
        for name, mod in model.named_modules():
            unsharded = False  # a frozen parameter or a buffer of this module was on the meta device
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
            kept = {i: self.params[i].detach().clone() if self.state[self._buckets_of(i)[0]] == LIVE
                    else None for i in mine if i in done}
            for i, value in kept.items():
                if value is None:
                    self.params[i].data = torch.empty(self.views[i].shape, dtype=self.dtype, device=self.device)
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
                    self.params[i].data = self.placeholder
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
    def _allocate(self, b: int, views: bool = True) -> None:
        """Bucket b's full storage exists again (its contents undefined); with `views`, its parameters are
        its views (a gather sets them when it is waited for, so nothing reads a bucket half written)."""
        full = self.full[b]
        nbytes = full.numel() * full.element_size()
        full.untyped_storage().resize_(nbytes)
        self.live += nbytes
        self.peak_live = max(self.peak_live, self.live)
        self.state[b] = LIVE
        if views:
            self._show(b)

    def _show(self, b: int) -> None:
        for i in self.bucket_params[b]:
            self.params[i].data = self.views[i]

    def start_gather(self, b: int) -> None:
        """Starts gathering bucket b into freshly allocated storage."""
        self._allocate(b, views=False)
        self.handles[b] = self._launch_gather(b)
        self.state[b] = GATHERING
        self.num_gathers += 1

    def _launch_gather(self, b: int):
        """Starts every rank's chunk of bucket b into its full storage (through `_comm`): flat, or in two
        levels over ranks on several nodes (across the nodes into the node chunk, then inside the node)."""
        if self.nodes is not None:
            return comm.start_two_level_all_gather(self.chunks[b], self._comm[b], self.node_group,
                                                   self.across_group, impl=self.impl)
        return comm.start_all_gather(self.chunks[b], self._comm[b], group=self.group, impl=self.impl)

    def finish_gather(self, b: int) -> None:
        t0 = time.perf_counter()
        self.handles.pop(b).wait()
        self.phase["gather"] += time.perf_counter() - t0
        self.state[b] = LIVE
        self._show(b)

    def reshard(self, b: int, even_persistent: bool = False) -> None:
        if self.state[b] == GATHERING:
            self.finish_gather(b)  # never free memory a collective is still writing
        if self.state[b] == FREE or (self.layout.buckets[b].persistent and not even_persistent):
            return
        for i in self.bucket_params[b]:
            self.params[i].data = self.placeholder
        self.full[b].untyped_storage().resize_(0)
        self.live -= self.full[b].numel() * self.full[b].element_size()
        self.state[b] = FREE

    def live_bytes(self) -> int:
        """Bytes of full parameters gathered now (persistent buckets included)."""
        return self.live

    def reset_peak(self) -> None:
        self.peak_live = self.live

    # ------------------------------------------------------------------ rounds
    def begin_forward(self) -> None:
        """The root module's forward starts: a forward round (Note [Stage-3 schedule])."""
        if self.round is not None:  # a pass that never ended (an exception): close it as every rank does
            self._close_round()
        self.round = self._new_round(Pass.FORWARD, self.schedule.forward)

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
        self._finish_round_gathers()
        keep_all = grad_enabled and not self.reshard_after_forward
        seam = self._seam if grad_enabled else ()
        for b in range(len(self.full)):
            if keep_all or b in seam:
                if self.state[b] == GATHERING:
                    self.finish_gather(b)
            else:
                self.reshard(b)
        self.round = None
        self.backwards_owed += int(grad_enabled)

    def _begin_backward(self) -> None:
        order = self.schedule.backward if self.reshard_after_forward else ()
        self.round = self._new_round(Pass.BACKWARD, order)
        self.round.pending = {b: len(self.bucket_params[b]) for b in order}
        if torch._C._current_graph_task_id() != -1:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """The backward pass is over (autograd's final callback): the rest of the round, then frees."""
        if self.round is not None and self.round.kind is Pass.BACKWARD:
            self._close_round()
            self.backwards_owed = max(0, self.backwards_owed - 1)

    def settle(self) -> None:
        """Before a step: backward rounds this rank owes (grad-enabled forwards whose backward reached none
        of its parameters, while other ranks' did), so every rank has walked the same rounds."""
        while self.backwards_owed:
            self._begin_backward()
            self.end_backward()

    def _close_round(self) -> None:
        self._finish_round_gathers()
        for b in range(len(self.full)):
            self.reshard(b)
        self.round = None

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

    def need(self, buckets) -> None:
        """A module is about to use these buckets (its forward, or a saved weight in backward)."""
        in_backward = torch._C._current_graph_task_id() != -1
        if self.round is None:
            if in_backward:
                self._begin_backward()
            else:  # a submodule called on its own, outside the root's forward
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
                    # extra gather (Note [Stage-3 schedule], the limit).
                    self._finish_round_gathers()
                    self.start_gather(b)
                else:
                    self._advance(at)
            self.finish_gather(b)
        self._advance(None)

    def forward_done(self, module_id: int, buckets) -> None:
        """A module's forward returned: buckets every waiting module has now used may go."""
        r = self.round
        if r is None or r.kind is not Pass.FORWARD or module_id in r.ran:
            return
        r.ran.add(module_id)
        seam = self._seam if torch.is_grad_enabled() else ()
        for b in buckets:
            r.users[b] -= 1
            if r.users[b] == 0 and self.reshard_after_forward and b not in seam:
                self.reshard(b)

    def before_accumulate(self, index: int) -> None:
        """Autograd is about to accumulate parameter `index`'s gradient (Note [Gradients of parameters not
        gathered]): a parameter whose bucket is not live gets a one-element stand-in of its shape."""
        p = self.params[index]
        if p.untyped_storage()._cdata == self._empty_storage:
            shape = self.layout.params[index].shape
            p.data = torch.zeros((), dtype=self.dtype, device=self.device).expand(shape)

    def grad_ready(self, index: int) -> None:
        """Parameter `index` has its gradient of this backward: its bucket may go once all have."""
        if all(self.state[b] != LIVE for b in self._bucket_of_param[index]):
            self.params[index].data = self.placeholder  # the stand-in goes (before_accumulate)
        if self.round is None:
            self._begin_backward()
        r = self.round
        if r.kind is not Pass.BACKWARD:
            return
        for b in self._bucket_of_param[index]:
            left = r.pending.get(b)
            if left is not None:
                r.pending[b] = left - 1
                if left == 1:
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
        if not self.on_meta:
            return False
        self.materialize(module, param_init_fn)  # Note [Meta-device models]
        return True

    def install_hooks(self, wrapper_ref, module, optimizer, waits) -> list:
        return hooks.install(self, wrapper_ref, module, optimizer, waits)

    def released(self, module: torch.nn.Module, orphaned: bool) -> None:
        if orphaned:
            hooks.refuse_orphan(module)

    def whole_copies(self) -> list:
        with self.gathered(writeback=False), torch.no_grad():
            return [p.detach().clone() for p in self.params]

    def publish(self, defer: bool) -> None:
        self.refresh_persistent()  # the next forward gathers the rest as it uses them

    def moved(self, index: int) -> bool:
        return not self.in_place(index)

    def param_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size() + self.live

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in a bucket's full storage (memory that a free gives back)."""
        return t.untyped_storage()._cdata in self._bucket_of_storage

    def pack(self, t: torch.Tensor):
        """Autograd saves `t` for backward: a view of a bucket is kept as where it lies, not as memory."""
        try:
            b = self._bucket_of_storage.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return t
        if b is None or self.layout.buckets[b].persistent:
            return t
        return (b, t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved):
        if not isinstance(saved, tuple):
            return saved
        b, size, stride, offset = saved
        self.need((b,))
        return self.full[b].as_strided(size, stride, offset)

    # ------------------------------------------------------------- whole weights
    @contextlib.contextmanager
    def gathered(self, writeback: bool = True):
        """Every bucket gathered (a collective: every rank enters); on exit this rank's chunk takes what
        the full parameters hold (writeback) and the buckets gathered for it are freed."""
        if self.round is not None:
            raise RuntimeError("full_params() inside a forward or backward pass: use it between steps")
        was_free = [b for b, s in enumerate(self.state) if s == FREE]
        for b in was_free:
            self.start_gather(b)
        for b in was_free:
            self.finish_gather(b)
        try:
            yield
        finally:
            if writeback:
                self.take_chunks()
            for b in was_free:
                self.reshard(b)

    @torch.no_grad()
    def take_chunks(self) -> None:
        """This rank's chunk of every gathered bucket from the full parameters (after they were written)."""
        for b in self.layout.buckets:
            if self.state[b.index] == LIVE:
                lo = self._lo[b.index]
                self.chunks[b.index].copy_(self.full[b.index][lo:lo + b.chunk_numel])

    def refresh_persistent(self) -> None:
        """After a step: the persistent buckets take every rank's updated chunk (as stage 2 publishes)."""
        keep = [b.index for b in self.layout.buckets if b.persistent]
        for b in keep:
            self.handles[b] = self._launch_gather(b)
            self.state[b] = GATHERING
            self.num_gathers += 1
        for b in keep:
            self.finish_gather(b)

    # ----------------------------------------------------------------- checks
    def in_place(self, index: int) -> bool:
        """Whether parameter `index` still holds what this shard put there (its bucket view, or the empty
        tensor while freed): Note [Parameters stay in the flat buffer] in optimizer.py, at stage 3."""
        p, view = self.params[index], self.views[index]
        if p.dtype != self.dtype:
            return False
        if p.numel() == 0 and view.numel():  # freed: the shared empty tensor, not an empty one of its own
            return p.untyped_storage()._cdata == self._empty_storage
        return p.data_ptr() == view.data_ptr() and p.shape == view.shape
