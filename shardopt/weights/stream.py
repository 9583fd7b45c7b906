"""load_weights and save_weights: a model's whole weights in and out of a Hugging Face folder, bucket by bucket.

Note [Weights streamed in and out]
----------------------------------
No rank ever holds the whole model (at stage 3 none can): both walk the optimizer's parameter store.
  in   Every rank reads the headers (reader.py), sees them as the model names them (conversions.py) and
       matches them (names.py): missing, unexpected or mis-shaped keys, a truncated file or a missing
       shard are refused on every rank before any value changes. Then each rank reads the parts of each
       store member in its chunks (`store.local_parts`), and everything else (buffers, frozen parameters
       at stages 1-2) whole. The masters take the chunks, or, where the file is finer than the model,
       their own pieces from it (Note [A load of the values held] in loads.py); the optimizer publishes.
       Extra memory: one part, at most a chunk.
  out  Rank 0 writes every header first (writer.py); then each rank writes the bytes it holds, its chunks
       and its share of the rest, into the same files (Note [Every rank writes its own bytes]), or, where
       the ranks do not share the destination, the store streams its members bucket by bucket and rank 0
       writes them. The folder appears at `dest` only when complete. Extra memory: none, or one bucket.
Every rank learns of a failure on any rank; one while reading values says the model is partly loaded.
Tied weights are read once and written once, under the first state-dict name.
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from shardopt.files import OWNER
from shardopt.parallel.consistency import exchange, first_failure
from shardopt.view import view_of, wrapper_of
from shardopt.weights.reader import open_weights
from shardopt.weights.writer import WeightWriter
from shardopt.weights.conversions import model_view
from shardopt.weights.names import (LoadPlan, base_name, is_adapter_name, match, model_tensors, peft_adapters,
                                    transformers_model)


class WeightsError(RuntimeError):
    """A load or save refused or failed (on some rank: every rank raises it)."""


class ModelParts:
    """The module, its optimizer's view and store (None without a ShardedDDP), and its tensors."""

    def __init__(self, model):
        wrapper = wrapper_of(model)
        self.module: nn.Module = wrapper.module if wrapper is not None else model
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"expected a model (a ShardedDDP or the module it wraps), got {type(model).__name__}")
        self.opt = view_of(wrapper.optimizer) if wrapper is not None else None
        self.store = self.opt.store if self.opt is not None else None
        if self.opt is not None:
            self.group = self.opt.world_group
        else:
            self.group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        members = {id(p): i for i, p in enumerate(self.store.members)} if self.store is not None else {}
        self.member_of = members
        shapes = {id(p): self.store.layout.params[i].shape for p, i in
                  ((p, members[id(p)]) for p in self.store.members)} if self.store is not None else {}
        self.tensors, self.values = model_tensors(self.module, lambda t: shapes.get(id(t), t.shape))
        if any(t.is_meta for t in self.values):
            raise ValueError("the model has tensors on the meta device: wrap it with ShardedDDP at stage 3 first "
                             "(it materialises the model shard by shard), then load its weights")

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0


def agree(group, error: BaseException | None, what: str) -> None:
    """Raises on every rank if `error` is set on any (so that no rank goes on into a collective alone)."""
    failed = first_failure(error, group)
    if failed:
        r, m = failed
        raise WeightsError(f"{what} failed on rank {r}, so every rank stops: {m}")


# ---------------------------------------------------------------------- in
def load_weights(model, source, *, strict: bool = True) -> LoadPlan:
    """Loads a model's weights from `source` on every rank (a collective); returns the plan it followed.

    `model`: a ShardedDDP or the module it wraps, at any stage, or a plain module. `source`: a Hugging Face
    folder, one safetensors file or a torch state-dict file, in any layout transformers reads for the model
    (Note [Converted tensors read by range]). Each rank reads only what it holds (Note [Weights streamed in
    and out]); a PEFT model takes its base model's checkpoint (Note [Weight names]). strict=False loads the
    keys that match (the plan lists the rest); mis-shaped keys are always refused.
    """
    m = ModelParts(model)
    plan = src = error = None
    try:
        src = open_weights(source)
        tf = transformers_model(m.module)
        adapters = peft_adapters(m.module)
        if tf is not None and (tf is m.module or adapters is not None):
            src = model_view(src, tf, {base_name(n, adapters): tuple(t.shape) for t in m.tensors for n in t.names})
        plan = match(m.tensors, {k: src.shape(k) for k in src.names()}, adapters,
                     getattr(tf, "base_model_prefix", "") or "",
                     getattr(tf, "_keys_to_ignore_on_load_missing", None) or (),
                     getattr(tf, "_keys_to_ignore_on_load_unexpected", None) or ())
        where = os.fspath(source)
        if plan.mismatched or strict:
            if problem := plan.problem(where):
                raise WeightsError(problem)
    except Exception as e:  # noqa: BLE001 - handed to agree, which raises it on every rank
        error = e
    try:
        agree(m.group, error, "load_weights")
        if m.opt is not None:
            m.opt.wait_params()  # gathers in flight write the parameters too
        error = None
        try:
            _write_values(m, src, plan)
        except Exception as e:  # noqa: BLE001
            error = e
        agree(m.group, error, "load_weights (the model is partly loaded: load it again)")
        if m.opt is not None:
            _masters_from_file(m, src, plan)
            m.opt.publish_params()
            m.store.after_load()
    finally:
        if src is not None:
            src.close()
    return plan


@torch.no_grad()
def _write_values(m: ModelParts, src, plan: LoadPlan) -> None:
    """This rank's parts of every store member, and every other tensor whole, from the file."""
    for t, key, value in zip(m.tensors, plan.keys, m.values):
        if key is None:
            continue
        i = m.member_of.get(id(value))
        if i is None:
            value.copy_(src.read(key, dtype=value.dtype).view(value.shape))
            continue
        for lo, hi, view in m.store.local_parts(i):
            view.copy_(src.read(key, lo, hi, dtype=view.dtype))


@torch.no_grad()
def _masters_from_file(m: ModelParts, src, plan: LoadPlan) -> None:
    """Masters from the chunks just written, or from a finer file (Note [A load of the values held], loads.py)."""
    opt = m.opt
    opt.load_master_from_model()
    key_of = {id(value): key for value, key in zip(m.values, plan.keys)}
    params = opt.params
    finer = {}  # piece index -> the file's key, for pieces the file holds more finely than the model
    for i, pc in enumerate(opt.pieces):
        param = params[pc.param]
        key = key_of.get(id(param))
        if key is not None and opt.master_dtype != param.dtype \
                and torch.finfo(src.dtype(key)).eps < torch.finfo(param.dtype).eps:
            finer[i] = key
    if not finer:
        return
    for members in opt.resident_pieces(write=True):  # a bucket at a time with the state on disk
        for i in finer.keys() & set(members):
            pc, master = opt.pieces[i], opt.piece_params[i]
            at = opt.layout.params[pc.param].offset
            master.copy_(src.read(finer[i], pc.start - at, pc.end - at, dtype=master.dtype))


# ---------------------------------------------------------------------- out
def whole_values(m: ModelParts):
    """(id of the model's tensor, its whole value) for every tensor of `m` once: the store's members gathered
    bucket by bucket (a collective every rank walks to its end), then buffers and unmanaged tensors."""
    if m.opt is not None:
        m.opt.wait_params()
    if m.store is not None:
        indices = [m.member_of[id(v)] for v in m.values if id(v) in m.member_of]
        for i, value in m.store.stream(indices):
            yield id(m.store.members[i]), value
    for v in m.values:
        if id(v) not in m.member_of:
            yield id(v), v.detach()


def save_weights(model, dest, max_shard_size="5GB", *, config: bool = True) -> str:
    """Writes a model's whole weights as a Hugging Face folder at `dest` on every rank (a collective); returns it.

    Safetensors shards of at most `max_shard_size` (one model.safetensors when it fits), under the module's
    own state-dict names, tied weights once; with `config`, a transformers model's config.json (and
    generation_config.json) beside them. The folder appears whole or not at all (Note [Weights streamed in
    and out]); where the ranks share the file system, each writes the bytes it holds (Note [Every rank writes
    its own bytes]).
    """
    m = ModelParts(model)
    dest = os.fspath(dest)
    entries = [(t.names[0], t.dtype, t.shape) for t in m.tensors]
    writer = error = None
    if m.rank == 0:
        try:
            writer = WeightWriter(dest, entries, max_shard_size, extra_files=_config_files(m.module) if config else None)
        except Exception as e:  # noqa: BLE001
            error = e
    agree(m.group, error, "save_weights")
    partial = _shared_partial(m, writer)
    if partial is not None:
        mine, own = {}, writer
        try:
            if own is None:
                own = WeightWriter(dest, entries, max_shard_size, into=partial)
            _write_held(m, own)
            if own is not writer:
                mine["written"] = own.finish()
        except Exception as e:  # noqa: BLE001 - rank 0 must learn of it and abandon the save
            mine = {"error": f"{type(e).__name__}: {e}"}
            if own is not None and own is not writer:
                own.abort()
        return _commit(m, dest, writer, mine)
    name_of = {id(v): t.names[0] for t, v in zip(m.tensors, m.values)}
    for key, value in whole_values(m):  # a collective: every rank walks it to its end
        if writer is not None and error is None:
            try:
                writer.write(name_of[key], value.detach().reshape(-1).cpu())
            except Exception as e:  # noqa: BLE001 - the other ranks are still gathering: keep walking
                error = e
    return _commit(m, dest, writer, {"error": f"{type(error).__name__}: {error}"} if error is not None else {})


# Note [Every rank writes its own bytes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Rank 0 lays the folder out, every header before any value (Note [Safetensors written in pieces] in format.py),
# so element lo of tensor t lands at a byte every rank can compute. When every rank reads back rank 0's owner
# line in its partial folder (a file system they share), each rank opens those files and writes what it holds:
# the store's members from its own chunks (`store.local_parts`, the first replica's ranks; a parameter that
# straddles chunks is written in parts by their holders) and every other tensor, whole on every rank, in equal
# element ranges by rank. Nothing is gathered: no tensor byte crosses the process group. Each rank makes its
# writes durable and hands rank 0 the ranges it wrote, which rank 0 counts (a hole refuses the commit) before
# the rename; the bytes are those rank 0 alone would write. Where the ranks do not share the destination,
# rank 0 writes everything as the store streams it.
def _shared_partial(m: ModelParts, writer) -> str | None:
    """Rank 0's partial folder if every rank sees it (a collective), else None."""
    if m.group is None or dist.get_world_size(m.group) == 1:
        return writer.partial
    box = [(writer.partial, _owner_line(writer.partial)) if writer is not None else None]
    dist.broadcast_object_list(box, group=m.group, group_src=0)
    partial, line = box[0]
    seen = [None] * dist.get_world_size(m.group)
    dist.all_gather_object(seen, _owner_line(partial) == line, group=m.group)
    return partial if all(seen) else None


def _owner_line(partial: str) -> str | None:
    try:
        with open(os.path.join(partial, OWNER)) as f:
            return f.read()
    except OSError:
        return None


@torch.no_grad()
def _write_held(m: ModelParts, writer: WeightWriter) -> None:
    """This rank's bytes of every tensor (Note [Every rank writes its own bytes])."""
    world, rank = (dist.get_world_size(m.group), m.rank) if m.group is not None else (1, 0)
    members = m.opt is None or m.opt.sharding.replica == 0
    if m.opt is not None:
        m.opt.wait_params()
    for t, value in zip(m.tensors, m.values):
        i = m.member_of.get(id(value))
        if i is None:
            numel = value.numel()
            lo, hi = numel * rank // world, numel * (rank + 1) // world
            if hi > lo:
                writer.write(t.names[0], value.detach().reshape(-1)[lo:hi], lo)
        elif members:
            for lo, hi, view in m.store.local_parts(i):
                writer.write(t.names[0], view, lo)


def _commit(m: ModelParts, dest: str, writer, mine: dict) -> str:
    """Every rank's outcome to rank 0, which counts what the peers wrote and commits (a collective)."""
    def commit(everyone: list) -> str:
        try:
            failed = [f"rank {dist.get_global_rank(m.group, r) if m.group is not None else r}: {e['error']}"
                      for r, e in enumerate(everyone) if "error" in e]
            if failed:
                raise WeightsError("; ".join(failed) + f" ({dest} was not written)")
            for e in everyone[1:]:
                writer.add_written(e.get("written", {}))
            writer.commit()
            return dest
        except BaseException:
            writer.abort()
            raise
    return exchange(m.group, mine, commit, f"save_weights to {dest}", WeightsError)


def _config_files(module: nn.Module) -> dict:
    """config.json (and generation_config.json) as save_pretrained writes them, for a transformers model."""
    if peft_adapters(module) is not None:
        return {}  # a PEFT model's names are not its base model's: no base config beside them
    tf = transformers_model(module)
    if tf is None or tf is not module:
        return {}
    config = copy.deepcopy(tf.config)
    config.architectures = [type(tf).__name__]  # as save_pretrained records it
    files = {"config.json": config.to_json_string(use_diff=True).encode()}
    gen = getattr(tf, "generation_config", None)
    if gen is not None and getattr(tf, "can_generate", lambda: False)():
        files["generation_config.json"] = gen.to_json_string(use_diff=True).encode()
    return files


# ------------------------------------------------------------ a model too big for one rank
@contextlib.contextmanager
def parameters_on_meta():
    """Inside, new modules' parameters are on the meta device and their buffers real (rotary tables and other
    buffers computed in __init__ keep their values): how from_pretrained builds a stage-3 model."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), **(
                {"requires_grad": param.requires_grad} if kind is nn.Parameter else {}))

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def from_pretrained(cls, folder, **kwargs) -> nn.Module:
    """`cls.from_pretrained(folder)` for a model no rank can hold, at stage 3: `cls(config)` built with its
    parameters on the meta device (`kwargs` override the folder's config), its weights loaded from `folder`
    when ShardedDDP takes it, each rank reading its shards. A PEFT model made from it takes the same weights."""
    config = cls.config_class.from_pretrained(os.fspath(folder), **kwargs)
    with parameters_on_meta():
        model = cls(config)
    model.shardopt_weights_from = os.fspath(folder)
    return model


def pending_weights(module: nn.Module) -> str | None:
    """The folder a from_pretrained model's weights come from, while not loaded yet, else None."""
    return next((m.shardopt_weights_from for m in module.modules() if getattr(m, "shardopt_weights_from", None)),
                None)


def init_for_pending(module: nn.Module):
    """The param_init_fn of a from_pretrained model: nothing for the model's own modules (the file gives
    their values); PEFT's initialisation for its adapters: lora_B (and a LoRA embedding's A) zero, the rest
    by reset_parameters()."""
    adapters = peft_adapters(module)
    if adapters is None:
        return lambda m: None
    kind = {}
    for name, m in module.named_modules():
        own = [n for n, _ in m.named_parameters(recurse=False)]
        if own and all(is_adapter_name(f"{name}.{n}", adapters) for n in own):
            kind[id(m)] = "zeros" if ".lora_B." in f"{name}." else "reset"
        elif any(n.startswith("lora_embedding_A") for n in own):
            kind[id(m)] = "embedding"

    def init(m: nn.Module) -> None:
        how = kind.get(id(m))
        if how == "zeros":
            for p in m.parameters(recurse=False):
                nn.init.zeros_(p)
        elif how == "reset" and hasattr(m, "reset_parameters"):
            m.reset_parameters()
        elif how == "embedding":  # PEFT's LoRA on an embedding: A zero, B normal
            for n, p in m.named_parameters(recurse=False):
                if n.startswith("lora_embedding_A"):
                    nn.init.zeros_(p)
                elif n.startswith("lora_embedding_B"):
                    nn.init.normal_(p)
    return init


def load_pending(wrapper, folder: str) -> None:
    """ShardedDDP took a model from_pretrained built: its weights now (a collective)."""
    load_weights(wrapper, folder)
    for m in wrapper.module.modules():
        m.__dict__.pop("shardopt_weights_from", None)
