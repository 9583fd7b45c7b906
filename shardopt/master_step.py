"""The step of this rank's chunks: the inner torch optimizer on its pieces, and their master values.

Note [Master weights]
---------------------
With an fp32 model and no offload, this rank's chunks of the model's parameters ARE the optimizer's
parameters. With a bf16/fp16 model or offload="cpu" the optimizer steps separate fp32 master chunks
(`master`, laid out like the gradient shard, on the host with offload); after a step each chunk is cast
into the model's (by the CPU Adam kernel in the same pass when it can) and published (publish.py). With
parameters crossing nodes in bf16 (Note [Parameters across nodes in bf16] in parallel/mesh_plan.py) an fp32
model gets masters too, and the cast is a rounding to bf16 (`round_to`). With offload="nvme" the masters and
the inner optimizer's state live in a scratch file and every pass over them walks it bucket by bucket
(Note [The optimizer's state on disk] in tiers/optimizer_state.py); the step then writes the model's chunk of
each bucket as it goes.
"""
from __future__ import annotations

import contextlib

import torch

from shardopt import offload as _offload
from shardopt.layout import Layout
from shardopt.tiers.optimizer_state import ALL, MASTER, NONE, StateTier, probe_state
from shardopt.tiers.pending_step import PendingStep


class MasterStep:
    """This rank's pieces as the inner optimizer's parameters, and their step. `model_chunks[b]`: a view of this
    rank's chunk of bucket b in the model; `shard_grad`: the bucket chunks' gradients, concatenated."""

    def __init__(self, layout: Layout, rank: int, model_chunks: list, shard_grad: torch.Tensor, param_groups,
                 optim, optim_kwargs: dict, *, master_dtype: torch.dtype, offloaded: bool, pin: bool, ops,
                 round_to: torch.dtype | None = None, disk=None, grad_file=None, hold_model=None):
        """disk: the ShardConfig when the masters and state live on disk (offload="nvme"); grad_file: the
        gradient shard's file then (tiers/grad_shard.py), dropped bucket by bucket as the step reads it;
        hold_model(b, read, write): bucket b's model chunk in memory for a block, when it lives on disk
        (offload_param="nvme": Note [The parameter shard on disk] in tiers/param_shard.py)."""
        self._hold_model = hold_model
        model_dtype = model_chunks[0].dtype if model_chunks else master_dtype
        self.master = None  # Note [Master weights]
        self.round_to = round_to
        self.grad_file = grad_file
        if disk is None and (offloaded or master_dtype != model_dtype or round_to is not None):
            self.master = _offload.zeros(layout.shard_numel(), master_dtype, shard_grad.device, pin, ops)
        chunk_offsets = layout.chunk_offsets()
        self.chunks = []  # per bucket: (this rank's chunk of the model, its master chunk)
        for b, model_chunk in enumerate(model_chunks):
            at = chunk_offsets[b]
            n = layout.buckets[b].chunk_numel  # (a chunk on disk is empty between uses)
            master_chunk = self.master[at:at + n] if self.master is not None else model_chunk
            if disk is not None:
                master_chunk = torch.empty(0, dtype=master_dtype)  # pointed at its record while walked
            self.chunks.append((model_chunk, master_chunk))
        self._chunk_at = [(at, at + b.chunk_numel) for at, b in zip(chunk_offsets, layout.buckets)]
        self.pieces = layout.pieces(rank)
        self._param_offsets = [layout.params[pc.param].offset for pc in self.pieces]  # where each piece's param starts
        self.piece_params, self.piece_grads, model_pieces = [], [], []
        inner_groups = [{k: v for k, v in g.items() if k != "params"} | {"params": []} for g in param_groups]
        for pc in self.pieces:
            bucket = layout.buckets[pc.bucket]
            inside = pc.start - bucket.chunk(rank)[0]  # where the piece starts inside its chunk
            model_chunk, master_chunk = self.chunks[pc.bucket]
            t = master_chunk[inside:inside + pc.numel] if disk is None else torch.empty(0, dtype=master_dtype)
            self.piece_params.append(t)
            model_pieces.append(model_chunk[inside:inside + pc.numel])
            at = chunk_offsets[pc.bucket] + inside
            self.piece_grads.append(shard_grad[at:at + pc.numel])
            inner_groups[bucket.group]["params"].append(t)
        self.tier = None
        self.pending = self.step_error = None  # a step left open, the error a step met (tiers/pending_step.py)
        self.grads_forgotten = False
        self.defer, self.walk_order, self.model_tier, self.phase = False, None, None, {"step": 0.0}
        if disk is not None:
            kinds, fills = probe_state(optim, optim_kwargs, [{k: v for k, v in g.items() if k != "params"}
                                                              for g in inner_groups], master_dtype)
            self.tier = StateTier(layout, rank, self.pieces, self.piece_params, [m for _, m in self.chunks],
                                  kinds, master_dtype, disk, fills)
        self.inner = optim(inner_groups, **optim_kwargs) if self.pieces else None
        if self.tier is not None:
            self.tier.attach(self.inner)
            self.tier.initialize(self._load_master_chunk)
            self.kernel_writes_model = hold_model is None and _offload.writes_lowp(self.inner, model_pieces,
                                                                                   separate_master=True)
            self._lowp_pairs = [[(self.piece_params[i], model_pieces[i]) for i, _, _ in members]
                                for members in self.tier.pieces_of]
            return
        self.load_from_model()
        # The kernel writes the model's pieces in place: not into chunks that live on disk.
        self.kernel_writes_model = _offload.attach_lowp_copies(
            self.inner, self.piece_params, model_pieces, separate_master=self.master is not None and hold_model is None)

    def _model(self, b: int, read: bool, write: bool):
        """Bucket b's model chunk in memory inside the block (always, unless it lives on disk)."""
        return self._hold_model(b, read, write) if self._hold_model is not None else contextlib.nullcontext()

    def _load_master_chunk(self, b: int, master: torch.Tensor) -> None:
        with self._model(b, read=True, write=False):
            master.copy_(self.chunks[b][0])

    @property
    def has_master(self) -> bool:
        """Whether the optimizer steps master values of its own, not the model's chunks (Note [Master weights])."""
        return self.master is not None or self.tier is not None

    def buckets(self, read=ALL, write=NONE):
        """Every bucket index in turn, its master chunk, pieces and state in memory meanwhile (with a tier:
        `read` and `write` say what of its record comes from and goes back to the file)."""
        if self.tier is None:
            yield from range(len(self.chunks))
        else:
            yield from self.tier.walk(read=read, write=write)

    def resident(self, read=ALL, write=NONE):
        """Lists of piece indices whose master values and state are in memory while the list is in hand: every
        piece at once, or with a tier the pieces of one bucket after another."""
        if self.tier is None:
            yield list(range(len(self.pieces)))
            return
        for b in self.tier.walk(buckets=self._stepped_buckets(), read=read, write=write):
            yield [i for i, _, _ in self.tier.pieces_of[b]]

    def _stepped_buckets(self) -> list[int]:
        return [b for b, members in enumerate(self.tier.pieces_of) if members]

    def step(self, used: torch.Tensor, param_groups) -> None:
        """One inner step on the pieces; `used[i]`: parameter i got a gradient on some rank."""
        if self.inner is None:
            return
        # As torch.optim: a parameter with no gradient anywhere is not stepped (no decay, no momentum).
        used = used.tolist()  # one conversion, not a tensor index per piece
        for inner_group, group in zip(self.inner.param_groups, param_groups):
            for k, v in group.items():
                if k != "params":
                    inner_group[k] = v
        if self.tier is not None:
            self._step_walked(used)
            return
        for pc, t, g in zip(self.pieces, self.piece_params, self.piece_grads):
            t.grad = g if used[pc.param] else None
        self.inner.step()

    def _step_walked(self, used: list) -> None:
        """The step bucket by bucket through the tier, left open for the next forward where `defer` says so (Note
        [The step walked in the next forward] in tiers/pending_step.py)."""
        self.settle()
        self.grads_forgotten = False
        order = self._stepped_buckets()
        if self.walk_order is not None:  # the next forward's gathers, then the rest
            stepped = set(order)
            first = [b for b in self.walk_order() if b in stepped]
            order = list(dict.fromkeys(first + order))
        pending = PendingStep(self.tier.start_walk(order, read=ALL, write=ALL),
                              lambda b: self._step_bucket(b, used), self.phase, self._step_ended)
        if not self.defer:
            pending.finish()
            self.raise_step_error()
            return
        self.pending = self.tier.pending = pending
        if self.model_tier is not None:
            self.model_tier.producer = pending

    def _step_bucket(self, b: int, used: list) -> None:
        """Bucket b's pieces stepped, its model chunk written as it goes, its gradient's pages dropped once read
        (Note [The gradient shard on disk] in tiers/grad_shard.py)."""
        members = [i for i, _, _ in self.tier.pieces_of[b]]
        for i in members:
            self.piece_params[i].grad = self.piece_grads[i] if used[self.pieces[i].param] else None
        if self.kernel_writes_model:
            self.inner.set_lowp_copies(self._lowp_pairs[b])
        self.inner.step()
        for i in members:
            self.piece_params[i].grad = None
        if not self.kernel_writes_model:
            with self._model(b, read=False, write=True):
                self._copy_chunk(*self.chunks[b])
        if self.grad_file is not None:
            if self.grads_forgotten:  # zero_grad came first (a step left open)
                self.grad_file.forget(*self._chunk_at[b])
            else:
                self.grad_file.drop(*self._chunk_at[b])

    def _step_ended(self, pending: PendingStep) -> None:
        self.pending = self.tier.pending = None
        if self.model_tier is not None:
            self.model_tier.producer = None
        if pending.error is not None and self.step_error is None:
            self.step_error = pending.error

    def leave_steps_open(self, phase: dict, model_tier, walk_order) -> None:
        """Steps leave their walk open for the next forward (Note [The step walked in the next forward]):
        model_tier, the parameter tier whose holds step a bucket first; walk_order(), the next forward's buckets."""
        self.defer, self.phase, self.model_tier, self.walk_order = True, phase, model_tier, walk_order

    def settle(self) -> None:
        """A step left open finished (Note [The step walked in the next forward]); its error is kept."""
        if self.pending is not None:
            self.pending.finish()

    def raise_step_error(self) -> None:
        """Raises the error a step met on this rank's disk (once)."""
        error, self.step_error = self.step_error, None
        if error is not None:
            raise error

    def forget_grads(self) -> None:
        """zero_grad(set_to_none=True) with the gradient shard on disk: its file zeroed without I/O, where a step
        left open has read it already; that step zeroes the rest as it goes."""
        if self.pending is None:
            self.grad_file.forget(0, self.grad_file.numel)
            return
        self.grads_forgotten = True
        for b, (lo, hi) in enumerate(self._chunk_at):
            if not self.pending.pending(b):
                self.grad_file.forget(lo, hi)

    @property
    def step_writes_model(self) -> bool:
        """Whether step() leaves the model's chunks updated (else copy_to_model does it)."""
        return self.kernel_writes_model or self.tier is not None

    @torch.no_grad()
    def load_from_model(self) -> None:
        """Master chunks take the model's values (at construction, after a broadcast or a load)."""
        if self.has_master:
            for b in self.buckets(read=NONE, write=MASTER):
                self._load_master_chunk(b, self.chunks[b][1])

    @torch.no_grad()
    def load_values(self, values: dict) -> None:
        """Master pieces take {parameter index: whole value} at master precision (Note [A load of the values held])."""
        for members in self.resident(read=MASTER, write=MASTER):
            for i in members:
                pc, at, t = self.pieces[i], self._param_offsets[i], self.piece_params[i]
                value = values.get(pc.param)
                if value is not None:
                    t.copy_(value.reshape(-1)[pc.start - at:pc.end - at])

    # Note [Writing back keeps the master's bits]
    # ----------------------------------------------
    # opt.full_params() hands out the model's weights, each its master rounded. A block that only reads them
    # (an EMA, generate()) must leave the masters alone: taken back wholesale, every master would be rounded
    # and an update below half an ulp never land. So only elements no longer the master's rounding are taken
    # (a loaded state dict is another matter: Note [A load of the values held]).
    @torch.no_grad()
    def take_model_writes(self) -> None:
        """Master chunks take the model's values where user code changed them (Note above)."""
        if not self.has_master:
            return  # the model's chunks are the optimizer's parameters
        for b in self.buckets(read=MASTER, write=MASTER):
            model_chunk, master_chunk = self.chunks[b]
            with self._model(b, read=True, write=False):
                model = model_chunk.to(master_chunk.device, copy=self._hold_model is not None)
            rounded = master_chunk if self.round_to is None else master_chunk.to(self.round_to)
            written = model != rounded.to(model.dtype)
            master_chunk.copy_(torch.where(written, model.to(master_chunk.dtype), master_chunk))

    @torch.no_grad()
    def copy_to_model(self, ops) -> bool:
        """Master chunks cast into the model's chunks; True if some copy may still be running on the device."""
        queued = False
        if self.has_master:
            for b in self.buckets(read=MASTER, write=NONE):
                model_chunk, master_chunk = self.chunks[b]
                with self._model(b, read=False, write=True):
                    non_blocking = _offload.copy_back_is_async(model_chunk, master_chunk, ops)
                    self._copy_chunk(model_chunk, master_chunk, non_blocking and self.tier is None)
                queued |= non_blocking and self.tier is None
        return queued

    def _copy_chunk(self, model_chunk: torch.Tensor, master_chunk: torch.Tensor, non_blocking: bool = False) -> None:
        src = master_chunk if self.round_to is None else master_chunk.to(self.round_to)
        model_chunk.copy_(src, non_blocking=non_blocking)

    def state_tensors(self) -> list:
        """The inner optimizer's state tensors (for memory accounting)."""
        if self.inner is None:
            return []
        return [v for s in self.inner.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
