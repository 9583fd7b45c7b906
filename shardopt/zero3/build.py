"""Stage 3's buckets take their values: rank 0's at construction, a meta-device model's from its own
initialisation (materialize), and the frozen parameters of each module a ShardedDDP adopts (take_frozen).

Note [Meta-device models]
-------------------------
`with torch.device("meta"): model = Big()` builds shapes without memory. At stage 3 no rank ever holds the
whole model: `materialize` walks the modules in registration order (the order their constructors ran),
gives a module's parameters storage in their buckets and its meta buffers storage of their own, and runs
what an eager build runs for it: reset_parameters(), then, inside a transformers model, the nearest
PreTrainedModel's `_init_weights(module)` (post_init's: norm weights, RoPE's inv_freq, BERT's position_ids,
Gemma's embed_scale); param_init_fn(module), if given, instead. So a seeded meta model of torch modules gets
the eager model's values, a transformers model its buffers' values and its parameters' distributions. Once
every parameter of a bucket has its value, rank 0's bucket is broadcast, each rank keeps its chunk and the
bucket is freed: at most the buckets of one module are whole at a time. A parameter tied to an earlier one
keeps the earlier value; an init that writes another module's parameters reaches them only while whole.
What the initialisation wrote is read from version counters (or a buffer replaced), not contents (zeros may
be a value). A non-persistent buffer left unwritten is in no checkpoint: the build is refused on every rank,
naming each. Parameters (without param_init_fn) and persistent buffers left unwritten stay zero, named in a
warning: a checkpoint gives them values (load_weights refuses one without).

Note [Frozen parameters at stage 3]
-----------------------------------
A frozen parameter (a LoRA model's base, a frozen encoder) is most of the model exactly when the model does
not fit, so stage 3 shards it like the trainable ones: the first ShardedDDP to take the module plans
buckets for the frozen floating-point parameters it finds (one region per dtype, the same bucket size and
persistence threshold) and appends them after the optimizer's buckets (layout.append_layout): the
optimizer's layout, chunks, gradients and state are unchanged, and a frozen bucket has a chunk of the
model's values here and nothing else. The schedule walks them with the rest. Backward is where they
differ: a trainable bucket is freed once its parameters have their gradients, and a frozen one never gets
any. So in a forward that will be differentiated, each module that waits for frozen buckets passes its
inputs that need a gradient through `AfterBackward` (rounds.py), an identity whose backward runs once the
module's own backward has produced its input gradients, after its last read of its saved weights, and
frees those buckets once every such call of the forward has come back (`owed`). A bucket that a module
used with no input needing a gradient is `held` and freed when the backward ends, as is whatever the walk
gathered that no backward asked for.
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

from shardopt.layout import append_layout, page_numel, plan_layout
from shardopt.parallel.consistency import first_failure
from shardopt.tiers.disk import made_everywhere
from shardopt.zero3.buckets import FREE, LIVE, Buckets

NON_PERSISTENT, PERSISTENT, PARAMETER = "non-persistent buffers", "persistent buffers", "parameters"


class Builder:
    """Gives `buckets` their values, and takes frozen parameters into them."""

    def __init__(self, buckets: Buckets, world_group, agree_group, persistence_threshold: int):
        self.buckets = buckets
        self.world_group, self.agree_group = world_group, agree_group
        self.persistence_threshold = persistence_threshold
        self.on_meta = None  # set by the first values taken

    @torch.no_grad()
    def shard_values(self, members: range, buckets) -> None:
        """Rank 0's values of `buckets` (as DDP broadcasts them); this rank keeps its chunk. Parameters on the
        meta device have no values yet: their buckets start freed and `materialize` fills them."""
        bk = self.buckets
        params = [bk.members[i] for i in members]
        on_meta = [p.is_meta for p in params]
        if any(on_meta) and not all(on_meta) or (params and self.on_meta is not None and on_meta[0] != self.on_meta):
            raise ValueError("stage 3 found some parameters on the meta device and others not: build the whole "
                             "model on the meta device (or none of it) before wrapping it")
        self.on_meta = bool(on_meta) and on_meta[0]
        if self.on_meta:  # a meta tensor cannot take real storage through .data; its contents can be swapped
            for p in params:
                torch.utils.swap_tensors(p, torch.nn.Parameter(bk.empty_of(p.dtype), requires_grad=p.requires_grad))
        for i in members:
            if not bk.layout.params[i].numel:  # in no bucket: it keeps a (empty) tensor of its own
                bk.members[i].data = bk.views[i]
        for b in buckets if not self.on_meta else ():
            bk.allocate(b.index, views=False)
            bk.full[b.index].zero_()  # padding
            for i in bk.bucket_params[b.index]:
                bk.views[i].copy_(bk.members[i].detach())
            bk.show(b.index)
            self.publish_full(b.index)

    def publish_full(self, b: int) -> None:
        """Bucket b's full values become rank 0's everywhere; this rank keeps its chunk of them."""
        bk = self.buckets
        full = bk.full[b]
        if dist.get_world_size(self.world_group) > 1:
            dist.broadcast(full, dist.get_global_rank(self.world_group, 0), group=self.world_group)
        if not bk.aliased:  # else the chunk is the bucket (Note [One rank holds the whole bucket])
            bk.write_chunk(b, bk.own_part(b))
        bk.reshard(b)

    @torch.no_grad()
    def materialize(self, model: torch.nn.Module, param_init_fn=None) -> None:
        """A meta-device model's values, from its modules' own initialisation (Note [Meta-device models])."""
        bk = self.buckets
        index = {id(p): i for i, p in enumerate(bk.members)}
        left = [len(members) for members in bk.bucket_params]
        done: set[int] = set()
        owners = _hf_owners(model)
        made: dict = {}  # id of a meta buffer -> (it, its real one): one two modules share stays shared
        unset: dict[str, list[str]] = {NON_PERSISTENT: [], PERSISTENT: [], PARAMETER: []}
        for name, mod in model.named_modules():
            prefix = f"{name}." if name else ""
            buffers = _real_buffers(mod, made, bk.device)
            loose = _real_loose_params(mod, index, bk.device)  # parameters the store does not hold
            mine = [index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index]
            fresh = {i for i in mine if i not in done}
            if not fresh and not buffers and not loose:
                continue
            for b in {b for i in fresh for b in bk.buckets_of_param[i]}:
                if bk.state[b] == FREE:
                    bk.allocate(b)
                    bk.full[b].zero_()
            # Tied to an earlier module's parameter: keep its value (in a scratch tensor once its bucket is freed).
            kept = {i: bk.members[i].detach().clone() if bk.state[bk.buckets_of_param[i][0]] == LIVE
                    else None for i in mine if i in done}
            for i, value in kept.items():
                if value is None:
                    bk.members[i].data = torch.empty_like(bk.views[i])
            params = {k: p for k, p in mod._parameters.items() if p is not None and index.get(id(p)) in fresh}
            params.update(loose)
            versions = {k: p._version for k, p in params.items()}
            _initialise(mod, param_init_fn, owners.get(id(mod)))
            for i, value in kept.items():
                if value is None:
                    bk.members[i].data = bk.empty_of(bk.views[i].dtype)
                else:
                    bk.views[i].copy_(value)
            for k, (t, version) in buffers.items():
                if not _written(mod._buffers.get(k), t, version):
                    unset[NON_PERSISTENT if k in mod._non_persistent_buffers_set else PERSISTENT].append(prefix + k)
            if param_init_fn is None:  # a param_init_fn may leave parameters to a load (shardopt.from_pretrained)
                unset[PARAMETER] += [prefix + k for k, p in params.items() if p._version == versions[k]]
            done.update(fresh)
            for i in fresh:
                for b in bk.buckets_of_param[i]:
                    left[b] -= 1
                    if left[b] == 0:
                        self.publish_full(b)
        for b, n in enumerate(left):
            if n and bk.state[b] != FREE:
                self.publish_full(b)
        self.on_meta = False
        _refuse_or_warn(unset, param_init_fn is not None, self.world_group)

    def take_frozen(self, module: torch.nn.Module) -> None:
        """The frozen floating-point parameters of `module` not held yet, sharded in buckets of their own after
        the others (Note [Frozen parameters at stage 3])."""
        bk = self.buckets
        held = {id(p) for p in bk.members}
        frozen: dict = {}  # dtype -> [(name, parameter)], each parameter once (tied ones under their first name)
        for name, p in module.named_parameters():
            if id(p) not in held and not p.requires_grad and p.is_floating_point():
                frozen.setdefault(p.dtype, []).append((name, p))
        if not frozen:
            return
        first_param, first_bucket = len(bk.members), len(bk.full)
        for dtype, named in frozen.items():
            start = len(bk.layout.params)
            shared = bk.gather.shared is not None
            part = plan_layout([[(name, tuple(p.shape)) for name, p in named]], bk.layout.world_size,
                               bk.layout.bucket_numel, bk.layout.bucket_numel, whole_params=True,
                               persistent=frozenset(i for i, (_, p) in enumerate(named)
                                                    if p.numel() <= self.persistence_threshold),
                               nodes=bk.layout.nodes,  # whole pages: Note [Stage-3 buckets mapped, not copied]
                               page_numel=page_numel(dtype.itemsize) if shared else 0)
            bk.layout = append_layout(bk.layout, part)
            bk.members += [p for _, p in named]
            new = bk.layout.buckets[len(bk.full):]
            chunks = bk.gather.add_frozen(new, dtype, self.agree_group) if shared else None
            if bk.tier is not None:  # on disk too (Note [The parameter shard on disk] in tiers/param_shard.py)
                chunks = made_everywhere(lambda: bk.tier.add(new, dtype), self.world_group)
            for k, b in enumerate(new):
                chunk = chunks[k] if chunks is not None else torch.empty(b.chunk_numel, dtype=dtype, device=bk.device)
                bk.every_chunk.append(chunk)
                bk.frozen_shard_bytes += chunk.numel() * chunk.element_size()
            bk.add(new, dtype)
            assert len(bk.layout.params) == start + len(named)
        self.shard_values(range(first_param, len(bk.members)), bk.layout.buckets[first_bucket:])
        bk.add_mappable(bk.gather.mappable())


# ------------------------------------------------------------------ a meta-device model's values
def _hf_owners(model: torch.nn.Module) -> dict:
    """id(module) -> the nearest transformers PreTrainedModel at or above it (whose post_init initialises it)."""
    tf = sys.modules.get("transformers.modeling_utils")
    owners: dict = {}
    if tf is None:
        return owners

    def walk(module, owner):
        owner = module if isinstance(module, tf.PreTrainedModel) else owner
        owners.setdefault(id(module), owner)
        for child in module.children():
            walk(child, owner)
    walk(model, None)
    return owners


def _initialise(module: torch.nn.Module, param_init_fn, owner) -> None:
    """What an eager build runs for `module`: reset_parameters(), then a transformers model's post_init."""
    if param_init_fn is not None:
        param_init_fn(module)
        return
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)  # MHA
    if callable(reset):
        reset()
    if owner is not None:
        owner._init_weights(module)


def _real_buffers(module: torch.nn.Module, made: dict, device) -> dict:
    """Zeros for module's own meta buffers: {key: (tensor, its version)}."""
    out = {}
    for key, buf in list(module._buffers.items()):
        if buf is not None and buf.is_meta:
            if id(buf) not in made:  # `made` keeps the meta tensor alive, so its id names no other
                made[id(buf)] = (buf, torch.zeros_like(buf, device=device))
            real = module._buffers[key] = made[id(buf)][1]
            out[key] = (real, real._version)
    return out


def _real_loose_params(module: torch.nn.Module, index: dict, device) -> dict:
    """Zeros for module's own meta parameters that the store does not hold (integer ones)."""
    out = {}
    for key, p in list(module._parameters.items()):
        if p is not None and p.is_meta and id(p) not in index:
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.zeros_like(p, device=device),
                                                           requires_grad=p.requires_grad))
            out[key] = p
    return out


def _written(now, made: torch.Tensor, version: int) -> bool:
    """Whether an initialisation wrote the buffer made for it, or put a real tensor in its place."""
    if now is not made:
        return now is None or not now.is_meta
    return made._version != version


def _refuse_or_warn(unset: dict, given_init: bool, group) -> None:
    error = None
    if unset[NON_PERSISTENT]:
        tried = "param_init_fn" if given_init else "reset_parameters(), a transformers model's _init_weights"
        error = ValueError(
            f"stage 3 cannot give these buffers of the meta-device model a value: {_names(unset[NON_PERSISTENT])}. "
            f"They are non-persistent (no checkpoint holds them) and their module's initialisation ({tried}) did "
            "not write them. Build a transformers model with shardopt.from_pretrained(cls, folder) (parameters on "
            "the meta device, buffers computed by the model's constructor), or give ShardedDDP a param_init_fn(module) "
            "that writes each of them in place (a write through .data is not seen)")
    failed = first_failure(error, group)  # raises `error` here; every rank learns of any rank's
    if failed:
        raise ValueError(f"rank {failed[0]} could not build the meta-device model: {failed[1]}")
    left = [f"{kind} {_names(names)}" for kind, names in unset.items() if names]
    if left:
        warnings.warn(f"stage 3 built these tensors of the meta-device model as zeros (no initialisation of "
                      f"their module wrote them): {'; '.join(left)}; load a checkpoint that holds them "
                      "(shardopt.load_weights)", UserWarning, stacklevel=6)  # the user's ShardedDDP(...)


def _names(names: list) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
