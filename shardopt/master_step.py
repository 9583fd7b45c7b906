"""The step of this rank's chunks: the inner torch optimizer on its pieces, and their master values.

Note [Master weights]
---------------------
When the model is fp32 and nothing is offloaded, this rank's chunks of the
model's parameters ARE the optimizer's parameters (no copy). With a bf16/fp16
model, or offload="cpu", the optimizer steps separate fp32 master chunks
(`master`, on the host with offload, laid out like the gradient shard); after
a step each bucket's chunk is cast into the model's chunk (by the CPU Adam
kernel itself when it can write the low-precision copy in the same pass) and
then published to the other ranks (publish.py). With parameters crossing
nodes in bf16 (Note [Parameters across nodes in bf16] in
parallel/mesh_plan.py) an fp32 model gets fp32 master chunks too, and the
cast into the model is a rounding to bf16 (`round_to`).
"""
from __future__ import annotations

import torch

from shardopt import offload as _offload
from shardopt.layout import Layout


class MasterStep:
    """This rank's pieces (layout.py) as the inner optimizer's parameters, and their step.

    `model_chunks[b]` is this rank's chunk of bucket b in the model's dtype (a
    view of the model's storage). `shard_grad` is the gradient shard: bucket
    chunks concatenated, as the bucket engine reduces into it.
    """

    def __init__(self, layout: Layout, rank: int, model_chunks: list, shard_grad: torch.Tensor, param_groups,
                 optim, optim_kwargs: dict, *, master_dtype: torch.dtype, offloaded: bool, pin: bool, ops,
                 round_to: torch.dtype | None = None):
        model_dtype = model_chunks[0].dtype if model_chunks else master_dtype
        self.master = None  # see Note [Master weights]
        self.round_to = round_to
        if offloaded or master_dtype != model_dtype or round_to is not None:
            self.master = _offload.zeros(layout.shard_numel(), master_dtype, shard_grad.device, pin, ops)
        chunk_offsets = layout.chunk_offsets()
        # Per bucket: (this rank's chunk of the model, its master chunk).
        self.chunks = []
        for b, model_chunk in enumerate(model_chunks):
            at = chunk_offsets[b]
            master_chunk = self.master[at:at + model_chunk.numel()] if self.master is not None else model_chunk
            self.chunks.append((model_chunk, master_chunk))
        self.pieces = layout.pieces(rank)
        self._param_offsets = [layout.params[pc.param].offset for pc in self.pieces]  # where each piece's param starts
        self.piece_params, self.piece_grads, model_pieces = [], [], []
        inner_groups = [{k: v for k, v in g.items() if k != "params"} | {"params": []} for g in param_groups]
        for pc in self.pieces:
            bucket = layout.buckets[pc.bucket]
            inside = pc.start - bucket.chunk(rank)[0]  # where the piece starts inside its chunk
            model_chunk, master_chunk = self.chunks[pc.bucket]
            t = master_chunk[inside:inside + pc.numel]
            self.piece_params.append(t)
            model_pieces.append(model_chunk[inside:inside + pc.numel])
            at = chunk_offsets[pc.bucket] + inside
            self.piece_grads.append(shard_grad[at:at + pc.numel])
            inner_groups[bucket.group]["params"].append(t)
        self.inner = optim(inner_groups, **optim_kwargs) if self.pieces else None
        self.load_from_model()
        # The CPU Adam kernel can write the model's bf16/fp16 copy itself (Note [Master weights]).
        self.kernel_writes_model = _offload.attach_lowp_copies(self.inner, self.piece_params, model_pieces,
                                                               separate_master=self.master is not None)

    def step(self, used: torch.Tensor, param_groups) -> None:
        """One inner step on the pieces; `used[i]`: parameter i got a gradient on some rank."""
        if self.inner is None:
            return
        # Torch.optim semantics: a parameter with no gradient anywhere is not
        # stepped at all (no weight decay, no momentum).
        used = used.tolist()  # one conversion, not a tensor index per piece
        for pc, t, g in zip(self.pieces, self.piece_params, self.piece_grads):
            t.grad = g if used[pc.param] else None
        for inner_group, group in zip(self.inner.param_groups, param_groups):
            for k, v in group.items():
                if k != "params":
                    inner_group[k] = v
        self.inner.step()

    @torch.no_grad()
    def load_from_model(self) -> None:
        """Master chunks take the model's values (at construction, after a broadcast or a load)."""
        if self.master is not None:
            for model_chunk, master_chunk in self.chunks:
                master_chunk.copy_(model_chunk)

    @torch.no_grad()
    def load_values(self, values: dict) -> None:
        """Master pieces take whole parameters' values at master precision: {parameter index: its full tensor}
        (a load that brings more precision than the model's dtype: Note [A load of the values held] in ddp.py)."""
        for pc, at, t in zip(self.pieces, self._param_offsets, self.piece_params):
            value = values.get(pc.param)
            if value is not None:
                t.copy_(value.reshape(-1)[pc.start - at:pc.end - at])

    # Note [Writing back keeps the master's bits]
    # ----------------------------------------------
    # opt.full_params() hands out the model's weights: with a bf16/fp16 model (or the bf16 parameter hop)
    # each is its master value rounded. A block that only reads them (an EMA, logging, generate()) must
    # leave the masters as they are: taking the model's values back wholesale rounded every master to the
    # model's dtype, so with a peek after every step a bf16 model at lr 1e-4 did not train at all (each
    # step's update is below half a bf16 ulp and was rounded away; seen at stages 1-3, 2026-11-27). So
    # writing back takes only the elements the block changed: those whose model value is no longer the
    # master's rounding. An element written to the value it already had keeps its master, which rounds to
    # it. Loading a state dict is different: there the model's values are the new truth, whole
    # (load_from_model), unless the load changed no value (Note [A load of the values held] in ddp.py).
    @torch.no_grad()
    def take_model_writes(self) -> None:
        """Master chunks take the model's values where user code changed them (Note above)."""
        if self.master is None:
            return  # the model's chunks are the optimizer's parameters
        for model_chunk, master_chunk in self.chunks:
            model = model_chunk.to(master_chunk.device)
            rounded = master_chunk if self.round_to is None else master_chunk.to(self.round_to)
            written = model != rounded.to(model.dtype)
            master_chunk.copy_(torch.where(written, model.to(master_chunk.dtype), master_chunk))

    @torch.no_grad()
    def copy_to_model(self, ops) -> bool:
        """Master chunks cast into the model's chunks; True if some copy may still be running on the device."""
        queued = False
        if self.master is not None:
            for model_chunk, master_chunk in self.chunks:
                non_blocking = _offload.copy_back_is_async(model_chunk, master_chunk, ops)
                src = master_chunk if self.round_to is None else master_chunk.to(self.round_to)
                model_chunk.copy_(src, non_blocking=non_blocking)
                queued |= non_blocking
        return queued

    def state_tensors(self) -> list:
        """The inner optimizer's state tensors (for memory accounting)."""
        if self.inner is None:
            return []
        return [v for s in self.inner.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
