"""Uneven numbers of batches under torch's Join: a rank that runs out shadows its peers until every rank has.

    with torch.distributed.algorithms.Join([model, opt]):   # or Join([model]), or model.join(), as with DDP
        for x, y in my_batches:                             # ranks may have different numbers of them
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()

Note [Join]
-----------
In torch's Join a rank with inputs left notifies (an all-reduce of a 1) before each iteration; a rank out of
inputs answers with a 0, then runs every joinable's `main_hook()`, which must issue the active ranks' exact
collectives. An iteration has four kinds of pass (LOOK: a forward without gradients; FORWARD; LOCAL: under
no_sync; STEP), so after each notification the ranks all-gather (pass, count, flags) and `decide` (pure) lets
the pass go ahead, lets LOOKs go ahead while the others shadow them, or raises on every rank. A joined rank
shadows each pass (`_shadow`), its shard stepped with the active ranks' clip (`before_update`). Refused: a
training forward whose backward has not run by the next pass (OWES), hybrid sharding, OneBitAdam. The cost,
under an enabled Join only: per pass one all-reduce of one element and one all-gather of three integers.
"""
from __future__ import annotations

import dataclasses
import enum
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig

from shardopt.parallel.mesh import copy_group


class Move(enum.IntEnum):
    """What a rank starts next under Join (Note [Join])."""
    JOINED = 0   # it ran out of inputs: it shadows what the others start
    LOOK = 1     # a forward without gradients
    FORWARD = 2  # a training forward whose backward reduces
    LOCAL = 3    # a training forward under no_sync
    STEP = 4     # the optimizer step


_WORDS = {Move.JOINED: "nothing (it has joined)", Move.LOOK: "a forward without gradients",
          Move.FORWARD: "a training forward", Move.LOCAL: "a training forward under no_sync",
          Move.STEP: "the optimizer step"}
_BUFFERS, _OWES = 1, 2  # flag bits: this forward broadcasts buffers; its last training forward's backward is owed


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one exchange decided, the same on every rank."""
    move: Move                 # the pass that goes ahead
    buffers_from: int | None   # global rank whose buffers every rank takes first, or None
    source: int                # the highest global rank among those going ahead
    joined: bool               # some rank has joined


def decide(everyone: list[tuple[int, int, int]], ranks: list[int]) -> Outcome:
    """The outcome of one exchange of (move, passes started, flags) per rank (pure; Note [Join])."""
    moves = [Move(m) for m, _, _ in everyone]
    owing = [(g, mv) for g, mv, (_, _, f) in zip(ranks, moves, everyone) if f & _OWES]
    if owing and Move.JOINED in moves:  # with every rank active, each walks its own rounds: nothing to shadow
        said = "; ".join(f"rank {g} started {_WORDS[mv]}" for g, mv in owing)
        raise RuntimeError(
            f"under torch's Join, {said} before the backward of its last training forward ran. A rank that has joined shadows a training forward and its backward as "
            "one, so each training forward's backward must run, once, before the rank's next forward or "
            "step: do not run two forwards before one backward, or a forward without gradients between a "
            "forward and its backward, under Join (or give every rank the same number of batches and drop "
            "the Join)")
    active = [(g, mv, f) for g, mv, (_, _, f) in zip(ranks, moves, everyone) if mv is not Move.JOINED]
    if not active:
        raise RuntimeError("under torch's Join every rank is in an exchange as joined: shardopt's join "
                           "bookkeeping is out of step with Join's (a bug)")
    if any(mv is Move.LOOK for _, mv, _ in active):
        going = [a for a in active if a[1] is Move.LOOK]
    elif len({mv for _, mv, _ in active}) == 1:
        going = active
    else:
        said = "; ".join(f"rank {g} started {_WORDS[mv]} (its pass {c})"
                         for g, mv, (_, c, _) in zip(ranks, moves, everyone))
        raise RuntimeError(f"under torch's Join the ranks are in different passes: {said}. The ranks still "
                           "training must run the same training forwards, backwards and steps (forwards "
                           "without gradients may differ in number)")
    flagged = [g for g, _, f in going if f & _BUFFERS]
    return Outcome(going[0][1], max(flagged) if flagged else None, max(g for g, _, _ in going),
                   len(active) < len(everyone))


class ShardedJoin:
    """A ShardedOptimizer's part in torch's Join, shared with its ShardedDDP (Note [Join])."""

    def __init__(self, optimizer):
        self.opt = optimizer
        self._wrapper = None
        self.group = None          # gloo copy of the world's ranks, made at the first Join (every rank)
        self.ranks: list[int] = []
        self.passes = 0            # passes agreed under Join (the errors name them)
        self.pending = None        # stage 3: a pass agreed here that the store asks about next (Intent's name)
        self.shadowing = False     # this rank is running a pass it shadows: the agreement is done
        self.backwards = 0         # ShardedDDP backward passes that reduced (ddp.py counts them)
        self._since = 0            # self.backwards at the last agreement
        self._awaiting = False     # the last agreed pass was a FORWARD whose backward is due
        self._forwards = 0         # FORWARDs agreed since the last step
        self._last: Move | None = None
        self._joined = False       # some rank had joined at the last agreement
        self._step: Outcome | None = None  # the step's agreement, for before_update
        self._entered = False      # this rank's first turn as joined is done
        self.turns = self.posts = 0  # main/post hook calls worked in this Join (_Hook)
        store = optimizer.store
        if not store.holds_whole:  # stage 3: its pass agreement is this one under Join
            store.set_join_agreement(self.store_agree)

    def attach(self, wrapper) -> None:
        self._wrapper = weakref.ref(wrapper)

    @property
    def wrapper(self):
        return self._wrapper() if self._wrapper is not None else None

    def enabled(self) -> bool:
        """Inside an enabled Join that lists the ShardedDDP or the optimizer (ShardedDDP.forward asks)."""
        w = self._wrapper() if self._wrapper is not None else None
        return self.opt._join_config.enable or (w is not None and w._join_config.enable)

    def make_hook(self, divide_by_initial_world_size: bool = True, **kwargs) -> JoinHook:
        """join_hook() of the ShardedDDP or the optimizer: called on every rank by Join(...)."""
        opt = self.opt
        if not divide_by_initial_world_size:
            raise NotImplementedError(
                "ShardedDDP under Join divides gradients by the initial world size only (DDP's default): "
                "drop divide_by_initial_world_size=False")
        if self.wrapper is None or not opt.grads.attached:
            raise RuntimeError("Join needs the ShardedOptimizer's model wrapped: shardopt.ShardedDDP(model, opt) "
                               "before `with Join([model, opt])`")
        if opt.onebit is not None:
            raise NotImplementedError("OneBitAdam under torch's Join is not supported: give every rank the same "
                                      "number of batches")
        if dist.get_world_size(opt.world_group) != dist.get_world_size(opt.process_group):
            raise NotImplementedError("torch's Join with hybrid sharding (replicas of the shard group) is not "
                                      "supported: shard flat, or give every rank the same number of batches")
        if self.group is None:  # a collective: every rank constructs the Join at the same point
            self.group = copy_group(opt.world_group, backend="gloo")
            self.ranks = [dist.get_global_rank(self.group, r) for r in range(dist.get_world_size(self.group))]
        self.turns = self.posts = 0
        self._entered = False
        self.pending, self._last, self._awaiting, self._forwards, self._joined = None, None, False, 0, False
        self._since = self.backwards
        return _Hook(self)

    def _first(self):
        for j in (self.wrapper, self.opt):
            if j is not None and j._join_config.enable and j._join_config.is_first_joinable:
                return j
        raise RuntimeError("torch's Join counts the notifications of the first joinable in its list: put the "
                           "ShardedDDP (or its ShardedOptimizer) first, e.g. Join([model, opt])")

    @torch.compiler.disable
    def before_forward(self, wrapper) -> int | None:
        """The forward's agreement; returns the global rank whose buffers every rank takes now, or None."""
        self.pending = None
        if not torch.is_grad_enabled():
            move = Move.LOOK
        else:
            move = Move.FORWARD if wrapper._sync else Move.LOCAL
        out = self._agree(move, buffers=wrapper.broadcast_buffers and wrapper._buffers_need_sync)
        if not self.opt.store.holds_whole:  # stage 3: its root forward asks next
            self.pending = "LOOK" if move is Move.LOOK else "FORWARD"
        return out.buffers_from

    def store_agree(self, intent) -> bool:
        """Stage 3's store starts a pass (a zero3.passes.Intent, by name): True if agreed here, under Join."""
        if not self.enabled():
            return False
        if self.shadowing:
            return True
        if self.pending == intent.name:
            self.pending = None
            return True
        self.pending = None
        if intent.name == "STEP":
            self.at_step()
        else:  # a submodule called outside the root's forward
            w = self.wrapper
            self._agree(Move.LOOK if intent.name == "LOOK" else
                        Move.FORWARD if w is None or w._sync else Move.LOCAL, buffers=False)
        self.pending = None
        return True

    def at_step(self) -> None:
        """The step's agreement, once this rank has joined its peers' backward reductions."""
        if not self.enabled() or self.shadowing or self._last is Move.STEP:
            return
        self._step = self._agree(Move.STEP)
        if not self.opt.store.holds_whole:
            self.pending = "STEP"

    def _owes(self, move: Move) -> bool:
        """Whether the last training forward's backward has not run once (Note [Join]: OWES)."""
        if self.opt.store.backwards_owed and move is not Move.STEP:
            return True  # stage 3: its backward round is still to be walked
        ran = self.backwards - self._since
        if not self._awaiting:
            return ran != 0
        # A training forward without a backward right before the step: the step reduces zeros for it.
        return ran != 1 and not (move is Move.STEP and ran == 0 and self._forwards == 1)

    def _agree(self, move: Move, buffers: bool = False) -> Outcome:
        self.passes += 1
        owes = self._owes(move)
        flags = (_BUFFERS if buffers else 0) | (_OWES if owes else 0)
        first = self._first()
        if owes and self._joined:
            self._pay()
        while True:
            Join.notify_join_context(first)  # raises with throw_on_early_termination once a rank has joined
            out = decide(self._exchange(move, flags), self.ranks)
            if out.move is move or move is Move.LOOK:
                break
            self._shadow(out)  # a peer's forward without gradients
        self._last, self._since, self._awaiting = move, self.backwards, move is Move.FORWARD
        self._joined = out.joined
        self._forwards = 0 if move is Move.STEP else self._forwards + (move is Move.FORWARD)
        return out

    def _pay(self) -> None:
        """The owed backward's collectives with zero gradients, to reach the exchange that raises (OWES)."""
        if self.opt.store.backwards_owed:
            self.opt.store.settle()
        if self._awaiting and self.backwards == self._since:
            self.opt.grads.begin_backward()
            self.opt.grads.end_backward(reached=False)

    def _exchange(self, move: Move, flags: int) -> list[tuple[int, int, int]]:
        out = [torch.zeros(3, dtype=torch.int64) for _ in self.ranks]
        dist.all_gather(out, torch.tensor([int(move), self.passes, flags], dtype=torch.int64), group=self.group)
        return [tuple(int(v) for v in t.tolist()) for t in out]

    @torch.no_grad()
    def before_update(self) -> None:
        """Before the update: joined ranks scale their pieces to the active ranks' clipped norms (Note [Join])."""
        if not self.enabled():
            return
        out = self._step
        if out is None or not (out.joined or self.shadowing):
            return
        grads = self.opt.grads
        shard = grads.shard
        cached = shard.cached_norms(2.0)  # kept through scalings, forgotten by other edits (a clamp)
        edited = not self.shadowing and (cached is None or shard.clamped_any or bool(grads.replaced_since))
        norms = torch.zeros(len(grads.params), dtype=torch.float64) if cached is None else \
            cached.detach().to("cpu", torch.float64)
        sent = torch.cat([norms, torch.tensor([float(edited)], dtype=torch.float64)])
        dist.broadcast(sent, out.source, group=self.group)
        if sent[-1] > 0:
            raise RuntimeError(
                "under torch's Join, p.grad was edited between backward and step other than by scaling "
                "(clip_grad_value_, a p.grad assigned or cleared) in a step where some rank has joined: the "
                "joined rank cannot repeat that on its shard of the gradients. Clip by norm (max_grad_norm=, "
                "opt.clip_grad_norm, torch.nn.utils.clip_grad_norm_) under Join")
        if not self.shadowing:
            return
        theirs, mine = sent[:-1], norms
        ratio = torch.where(mine > 0, theirs / torch.where(mine > 0, mine, 1.0), 1.0)
        for value in torch.unique(ratio).tolist():
            if value != 1.0:
                shard.scale((ratio == value).nonzero().flatten().tolist(), value)

    def turn(self) -> None:
        """One turn of Join's exit loop on this rank, which has joined: the exchange, then the pass."""
        if not self._entered:
            self._entered = True
            if self.opt.grads.backwards == 0:  # gradients it kept without stepping them (a no_sync backward)
                self.opt.zero_grad(set_to_none=True)
        self._shadow(decide(self._exchange(Move.JOINED, 0), self.ranks))

    def _shadow(self, out: Outcome) -> None:
        """The collectives of the pass `out` says the active ranks run (Note [Join])."""
        opt, w = self.opt, self.wrapper
        if out.buffers_from is not None:
            w._broadcast_coalesced(w._module_buffers(), out.buffers_from)
        store = opt.store
        if out.move is not Move.STEP:
            opt.wait_params()  # a forward first waits for the last step's gathers (overlap_gather)
        if out.move is Move.LOOK:
            if not store.holds_whole:
                store.shadow_look()
            return
        self.shadowing = True
        try:
            if out.move is Move.STEP:
                self._step = out
                opt.step()
            else:
                if not store.holds_whole:  # the forward's gathers keeping the seam, then the backward round's
                    with torch.enable_grad():
                        store.begin_forward()
                    store.end_forward(True)
                    store.settle()
                if out.move is Move.FORWARD:  # zeros into every bucket's reduction, as a rank with no backward
                    opt.grads.begin_backward()
                    opt.grads.end_backward(reached=False)
        finally:
            self.shadowing = False
        if out.move is Move.STEP:
            opt.zero_grad(set_to_none=True)

    def finish(self, is_last_joiner: bool) -> None:
        """Every rank has joined: buffers from the last joiner (DDP's final sync); Join's settings reset."""
        w = self.wrapper
        if w is not None and w.broadcast_buffers and any(b.numel() for b in w._module_buffers()):
            me = torch.tensor([dist.get_rank() if is_last_joiner else -1], dtype=torch.int64)
            dist.all_reduce(me, op=dist.ReduceOp.MAX, group=self.group)
            w._broadcast_coalesced(w._module_buffers(), int(me))
        off = _JoinConfig.construct_disabled_join_config()
        for j in (w, self.opt):
            if j is not None:
                j._join_config = off
        self.pending, self._step = None, None


class _Hook(JoinHook):
    """The join hook of a ShardedDDP or a ShardedOptimizer: both work their shared ShardedJoin once per turn."""

    def __init__(self, joining: ShardedJoin):
        self.joining = joining
        self.calls = self.posts = 0

    def main_hook(self) -> None:
        self.calls += 1
        if self.calls > self.joining.turns:  # the first of this Join's hooks to reach the turn works it
            self.joining.turns += 1
            self.joining.turn()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.posts += 1
        if self.posts > self.joining.posts:
            self.joining.posts += 1
            self.joining.finish(is_last_joiner)
