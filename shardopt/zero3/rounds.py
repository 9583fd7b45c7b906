"""Stage 3's rounds: walking the schedule (Note [Stage-3 schedule] in schedule.py) pass by pass.

    rounds = Rounds(buckets, config, agree_group, agree_shm)
    rounds.attach(schedule)
    rounds.begin_forward(); rounds.need(buckets); rounds.forward_done(...); rounds.end_forward(grad_enabled)
    rounds.begin_backward(); rounds.bucket_grads_done(b); rounds.end_backward()
    rounds.settle(); rounds.start_step()

A round is one pass's walk: the gathers it issued and what may be freed. Passes are agreed across ranks
before they start (Note [Passes every rank agrees on] in passes.py).
"""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from shardopt.zero3.buckets import FREE, GATHERING, LIVE, Buckets
from shardopt.zero3.passes import Intent, describe, exchange


class Pass(str, enum.Enum):
    """Which pass a round walks the schedule for (Note [Stage-3 schedule])."""
    FORWARD = "forward"
    BACKWARD = "backward"


class Round:
    """One pass of the schedule: which gathers were issued, what may be freed."""

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
        self.serves = False              # forward: it ends by serving gathers asked again (`serve`)
        self.training = False            # forward: a backward will follow (it keeps the seam)


class AfterBackward(torch.autograd.Function):
    """The identity on a module's inputs; its backward (the module's input gradients are done) tells the
    rounds (Note [Frozen parameters at stage 3] in build.py)."""

    @staticmethod
    def forward(ctx, rounds, buckets, *inputs):
        ctx.rounds, ctx.buckets = rounds, buckets
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.rounds.backward_done(ctx.buckets)
        return (None, None) + grads


# Note [The seam between forward and backward]
# ---------------------------------------------
# With reshard_after_forward the forward frees a bucket once its modules have returned, and the backward
# gathers it again. The buckets the backward round starts with (the root's own layers and the last block:
# as many as the backward's first wait plus its prefetch would gather) are the last the forward used, and
# nothing runs between the two passes that could hide their gather: freeing them only to wait for them
# again at once costs an exposed gather per step and saves no peak memory. So a forward whose backward will
# follow keeps them (FSDP2 likewise does not reshard the root after forward); a no-grad forward frees all.
#
# Note [A module called again]
# ----------------------------
# Within one pass a module may run as often as the data says, differently on every rank: adaptive depth,
# recurrent refinement, an MoE expert once per token group. Every rank still walks the whole round; what
# differs is buckets needed again after the walk has passed them. Two rules serve them.
#   Kept for their scope. In forward, a bucket whose waiting modules have all returned is not freed at
#   once: it is `spent`, with a scope (the module's own buckets; for a layer of an nn.Sequential below the
#   root, the Sequential's buckets if at most reuse_limit() of them are not the root's own:
#   schedule.plan_reuse_scopes). It is freed when a module starts that needs a bucket outside that scope,
#   or when the forward ends. Releases are local, so no collective changes, and a module called again at
#   once finds its buckets gathered.
#   Asked again. A module that needs a bucket after it was freed (A, B, A) has no local answer: a gather of
#   its own would pair with whatever collective each peer issues next. So the rank first issues the rest
#   of the round's gathers (each freed as it arrives, so the memory bound holds), then says which bucket it
#   needs in an exchange on the agreement group (AGAIN, bucket), and every forward ends with the same
#   exchange saying -1, repeated until no rank asks. Every rank reads the same outcome and gathers each
#   bucket asked for, in rank order (kept by the ranks that asked; a rank holding it gathers into scratch
#   memory). A rank whose forward ended first waits in its end exchange, before any collective of its
#   backward, so the extra gathers pair rank by rank whatever each rank's data did.
# The cost: one all-gather of two integers per forward with several ranks and reshard_after_forward=True;
# none with False. Backward needs neither rule: it frees a bucket only once all of its parameters have their
# gradient. A round that began without the root's forward (a submodule called on its own) does not end with
# the exchange: there a bucket needed again takes a gather of this rank's alone. An AGAIN exchange that
# meets a pass agreement (ranks out of step) raises on every rank, naming what each was doing.
class Rounds:
    """The walk of stage 3's schedule over `buckets`, one round per pass."""

    def __init__(self, buckets: Buckets, config, agree_group, agree_shm):
        self.buckets = buckets
        bucket = buckets.layout.bucket_numel
        self.prefetch = 1 if config.prefetch_bucket_size is None else -(-config.prefetch_bucket_size // bucket)
        self.max_live = None if config.max_live_parameters is None else max(1, config.max_live_parameters // bucket)
        self.reshard_after_forward = config.reshard_after_forward
        self.read_ahead = config.offload_buffer_count  # chunks read ahead of a gather, with the parameter tier
        self.agree_group, self.agree_shm = agree_group, agree_shm
        self.passes_started, self.last_intent = 0, None
        self.join_agree = None  # under torch's Join the agreement is its (Note [Join] in shardopt/join.py)
        self.schedule = None
        self.seam: frozenset = frozenset()  # Note [The seam between forward and backward]
        self.round: Round | None = None
        self.backwards_owed = 0  # grad-enabled forwards whose backward round has not run on this rank
        self.num_again = 0  # gathers some rank asked for again (Note [A module called again])
        self.grad_hooks = None  # the C++ gradient hooks of the wrapper attached now (hooks.install)
        # Note [Frozen parameters at stage 3] in build.py: frozen buckets freed after their modules' backward.
        self.owed: dict[int, int] = {}
        self.held: set = set()  # frozen buckets some forward used with no input needing a gradient

    def attach(self, schedule) -> None:
        self.schedule = schedule
        self.seam = frozenset(schedule.backward[:self.reuse_limit()])

    def reuse_limit(self) -> int:
        """The most buckets a scope of Note [A module called again] may keep: as many as a module's wait and
        its prefetch gather (the seam's depth)."""
        return 1 + self.prefetch if self.max_live is None else max(1, min(1 + self.prefetch, self.max_live))

    def in_pass(self) -> bool:
        return self.round is not None

    # ------------------------------------------------------------ agreements
    def start(self, intent: Intent) -> None:
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
                raise RuntimeError(describe(everyone, self._global_ranks(everyone)))
            if intent is Intent.LOOK or all(p is intent for p, _ in everyone):
                return  # a forward without gradients goes ahead: the others shadow it
            if any(p is Intent.LOOK for p, _ in everyone):
                self.shadow_look()
                continue
            raise RuntimeError(describe(everyone, self._global_ranks(everyone)))

    def _global_ranks(self, everyone) -> list[int]:
        return [dist.get_global_rank(self.agree_group, r) for r in range(len(everyone))]

    def shadow_look(self) -> None:
        """The gathers of another rank's forward without gradients, each bucket freed as it arrives."""
        bk = self.buckets
        for b in self.schedule.forward:
            if bk.state[b] == FREE:
                bk.start_gather(b)
                bk.reshard(b)
        if self._serving():  # the LOOK ends by serving what it asks for again (Note [A module called again])
            self.serve(-1)
        bk.end_reads()

    def catch_up(self) -> None:
        """Every rank calls it at the same point of its program: a rank that ran fewer forwards without
        gradients than a peer walks the peer's extra gathers here (Note [Models sharded for inference])."""
        self.last_intent = None  # never skipped, as a second step() after clip_grad_norm() is
        self.start(Intent.SYNC)

    def start_step(self) -> None:
        # Once this rank has joined its peers' backward reductions, not in settle(): a rank whose backward
        # reached none of the store's buckets joins them from its step, after settle(), and a peer waiting
        # there would wait for an agreement this rank has not reached (Note [Passes every rank agrees on]).
        self.start(Intent.STEP)

    def _serving(self) -> bool:
        """Whether forwards end with `serve` (Note [A module called again]): with several ranks, and only where
        a forward frees buckets (reshard_after_forward=False frees nothing before the backward)."""
        return self.agree_group is not None and self.reshard_after_forward

    # ---------------------------------------------------------------- passes
    def _new_round(self, kind: Pass, order: tuple) -> Round:
        state = self.buckets.state
        self.buckets.read_ahead([b for b in order if state[b] == FREE][:self.read_ahead])
        return Round(kind, order, self.schedule.users, frozenset(b for b in order if state[b] != FREE))

    def begin_forward(self) -> None:
        """The root module's forward starts: a forward round (Note [Stage-3 schedule])."""
        if self.round is not None:  # a pass that never ended (an exception): close it as every rank does
            self._close_round()
        self.buckets.install_maps()
        self.start(Intent.FORWARD if torch.is_grad_enabled() else Intent.LOOK)
        self.round = self._new_round(Pass.FORWARD, self.schedule.forward)
        self.round.serves = self._serving()
        self.round.training = torch.is_grad_enabled()

    def end_forward(self, grad_enabled: bool) -> None:
        """The root module's forward returned (or raised): the rest of the round, then frees. With
        reshard_after_forward=False a forward whose backward will follow keeps everything gathered for it;
        with True it keeps the buckets that backward needs first (Note [The seam between forward and
        backward])."""
        if self.round is None or self.round.kind is not Pass.FORWARD:
            return
        bk = self.buckets
        keep_all = grad_enabled and not self.reshard_after_forward
        seam = self.seam if grad_enabled else ()
        if keep_all:
            self._finish_round_gathers()
        else:
            self._drain_round(keep=seam)
        if self.round.serves:  # the gathers peers ask for again, until every rank's forward has ended
            self.serve(-1)
        for b in range(len(bk.full)):
            if keep_all or b in seam:
                if bk.state[b] == GATHERING:
                    bk.finish_gather(b)
            else:
                bk.reshard(b)
        self.round = None
        bk.end_reads()
        if bk.tier is not None:
            bk.tier.settle()  # before a backward writes the gradients (Note [The step walked in the next forward])
        self.backwards_owed += int(grad_enabled)

    def begin_backward(self) -> None:
        # No agreement here (Note [Passes every rank agrees on]): a rank whose backward reached none of the
        # store's buckets walks this round in settle(), after collectives its peers' backward runs first.
        if self.buckets.tier is not None:
            self.buckets.tier.settle()  # Note [The step walked in the next forward] in tiers/pending_step.py
        order = self.schedule.backward if self.reshard_after_forward else ()
        self.round = self._new_round(Pass.BACKWARD, order)
        bk = self.buckets
        pending = [-1] * len(bk.full)  # per bucket: parameters still without a gradient (-1: not counted)
        for b in order:
            if b < bk.trainable:
                pending[b] = len(bk.bucket_params[b])
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
            self.begin_backward()
            self.end_backward()

    def _close_round(self) -> None:
        if self.grad_hooks is not None and self.round.kind is Pass.BACKWARD:
            self.grad_hooks.disarm()
        self._drain_round()
        for b in range(len(self.buckets.full)):
            self.buckets.reshard(b)
        if self.round.kind is Pass.BACKWARD:
            self.owed.clear()
            self.held.clear()
        self.round = None
        self.buckets.end_reads()

    # ------------------------------------------------------------------ walk
    def _drain_round(self, keep=()) -> None:
        """The round's gathers no module asked for (a skipped module's, a frozen layer's that no backward
        reaches), each freed once it arrives unless in `keep`: at most one such bucket at a time."""
        r, bk = self.round, self.buckets
        while r.pos < len(r.order):
            b = r.order[r.pos]
            was_free = bk.state[b] == FREE
            self._issue_position()
            if was_free and b not in keep:
                bk.reshard(b)

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
        if self.buckets.state[b] == FREE and b not in r.carried:
            self.buckets.start_gather(b)
            self.buckets.read_ahead(r.order[r.pos:r.pos + self.read_ahead])  # Note [The parameter shard on disk]

    def _room(self) -> bool:
        if self.max_live is None:
            return True
        bk = self.buckets
        live = sum(1 for b, s in enumerate(bk.state) if s != FREE and not bk.layout.buckets[b].persistent)
        return live < self.max_live

    # Note [A module whose buckets are gathered]
    # -----------------------------------------
    # need() runs for every module that waits and for every weight a backward unpacks. Most calls find every
    # bucket gathered and the walk already past them and their prefetch: the full walk below would change
    # nothing, so the fast path returns after reading the states and positions alone. It answers only when
    # the walk would have done nothing, so every rank's schedule is the same gather for gather.
    def need(self, buckets) -> None:
        """A module is about to use these buckets (its forward, or a saved weight in backward)."""
        r, bk = self.round, self.buckets
        if r is not None and r.spent:  # Note [A module called again]: a module of another bucket frees them
            self._spend(r, buckets)
        if r is not None:  # Note [A module whose buckets are gathered]
            state, position, needed = bk.state, r.position, r.needed
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
                self.begin_backward()
            else:  # a submodule called on its own, outside the root's forward
                self.start(Intent.FORWARD if torch.is_grad_enabled() else Intent.LOOK)
                self.round = self._new_round(Pass.FORWARD, self.schedule.forward)
        r = self.round
        for b in buckets:
            if bk.state[b] != FREE:
                r.needed = max(r.needed, r.position.get(b, -1))
            if bk.state[b] == LIVE:
                continue
            if bk.state[b] == FREE:
                at = r.position.get(b, -1)
                if at < r.pos or b in r.carried:
                    # Needed again after it was freed in this pass: the rest of the round first, then one
                    # extra gather, which every rank joins (Note [A module called again]).
                    if r.serves:
                        self._drain_round(keep=self.seam if r.training else ())
                        self.serve(b)
                    else:
                        self._finish_round_gathers()
                        bk.start_gather(b)
                else:
                    self._advance(at)
            if bk.state[b] == GATHERING:
                bk.finish_gather(b)
        self._advance(None)

    def _spend(self, r: Round, buckets) -> None:
        """A module starts: a bucket kept after its modules returned stays while the module needs only buckets
        of the kept one's scope (the module again, or its block), and goes otherwise."""
        spent = r.spent
        for b, scope in list(spent.items()):
            if not all(x in scope for x in buckets):
                del spent[b]
                self.buckets.reshard(b)

    def serve(self, want: int) -> None:
        """Asks every rank for bucket `want` again (or, -1, says this rank's forward has ended) and gathers
        every bucket some rank asks for, in rank order; with -1, until no rank asks (Note [A module called
        again])."""
        while True:
            everyone = exchange(Intent.AGAIN, want, self.agree_group, self.agree_shm)
            if any(p is not Intent.AGAIN for p, _ in everyone):
                if self.round is not None:
                    self.round.serves = False  # the forward's end (its hook runs on the way out) asks no more
                raise RuntimeError(describe(everyone, self._global_ranks(everyone)))
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
        bk = self.buckets
        if bk.state[b] == FREE:
            bk.start_gather(b)
            if keep:
                bk.finish_gather(b)
            else:
                bk.reshard(b)  # a collective's gather is finished first; one through shared memory copies nothing
            return
        if bk.state[b] == GATHERING:
            bk.finish_gather(b)
        if bk.through_shared_memory(b):  # no peer waits for this rank's part
            bk.num_gathers += 1
            return
        bk.gather_into_scratch(b)

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
        seam = self.seam if r.training or torch.is_grad_enabled() else ()
        scope = frozenset(buckets) if scope is None else scope
        for b in buckets:  # kept until a module outside its scope starts (Note [A module called again])
            if r.users[b] <= 0 and b not in seam and self.buckets.state[b] != FREE:
                r.spent[b] = scope

    def bucket_grads_done(self, b: int) -> None:
        """Every parameter of bucket b has its gradient of this backward (the C++ hooks' count): it may go."""
        r = self.round
        if r is not None and r.kind is Pass.BACKWARD:
            self.buckets.reshard(b)

    # ------------------------------------------------- frozen buckets in backward
    def after_backward(self, buckets: tuple, args: tuple, kwargs: dict):
        """A module's forward pre-hook, in a forward that will be differentiated: its inputs that need a
        gradient pass through AfterBackward, which frees `buckets` (frozen) once the module's backward is
        done (Note [Frozen parameters at stage 3] in build.py). Returns the new (args, kwargs), or None if no
        input needs a gradient (the buckets are then held until the backward ends)."""
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        at = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            self.held.update(buckets)
            return None
        outs = AfterBackward.apply(self, buckets, *(leaves[k] for k in at))
        for k, out in zip(at, outs):
            leaves[k] = out
        for b in buckets:
            self.owed[b] = self.owed.get(b, 0) + 1
        return torch.utils._pytree.tree_unflatten(leaves, spec)

    def backward_done(self, buckets: tuple) -> None:
        for b in buckets:
            self.owed[b] = self.owed.get(b, 0) - 1
            if self.owed[b] <= 0 and b not in self.held and self.round is not None \
                    and self.round.kind is Pass.BACKWARD:
                self.buckets.reshard(b)
