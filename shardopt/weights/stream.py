"""load_weights and save_weights: a model's whole weights in and out of a Hugging Face folder, bucket by bucket.

Note [Weights streamed in and out]
----------------------------------
Pretrained weights in, whole weights out, and no rank ever holding the whole model (at stage 3 no rank
can). Both walk the optimizer's parameter store (param_store.ParamStore), not a state dict:
  in   Every rank first reads the file's header (names, dtypes, shapes, byte ranges: hf_files.py) and
       matches it to the model (names.py): missing, unexpected or mis-shaped keys, a truncated file or a
       missing shard are refused on every rank before any value changes. Then each rank reads exactly
       the elements it holds: for a store member the parts of it that lie in this rank's chunks
       (`store.local_parts`), cast to the model's dtype; for everything else (buffers, and frozen
       parameters at stages 1-2, which every rank holds whole) the whole tensor. The masters take the
       chunks, and where the file is finer than the model (fp32 values, a bf16 model) their own pieces
       straight from the file at master precision (as a load_state_dict does: Note [A load of the values
       held] in loads.py); then the optimizer publishes, so stages 1-2 all-gather the new chunks and
       stage 3 refreshes its persistent buckets. Extra memory: one part at a time, at most a chunk.
  out  The entries (name, dtype, shape) are known from the layout, so rank 0 writes every file's header
       first (hf_files.WeightWriter), then the store streams its members bucket by bucket (at stage 3 each
       bucket gathered, written, freed: `store.stream`) and rank 0 writes each parameter's bytes where
       the header put them; buffers and unmanaged tensors follow. The folder appears at `dest` only once
       complete (a temporary folder renamed); every rank learns of a failure on any rank. Extra memory:
       one bucket.
A failure while reading values (an I/O error after the checks) leaves the model partly loaded: it says
so on every rank. Tied weights are read once and written once, under the first state-dict name.
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from shardopt.parallel.consistency import first_failure
from shardopt.view import view_of, wrapper_of
from shardopt.weights.hf_files import WeightWriter, open_weights
from shardopt.weights.names import (LoadPlan, is_adapter_name, match, model_tensors, peft_adapters,
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

    `model` is a ShardedDDP or the module it wraps, at any stage (a meta-built stage-3 model once wrapped),
    or a plain module. `source` is a Hugging Face model folder (model.safetensors, or the sharded
    model.safetensors.index.json, or the pytorch_model.bin equivalents), one safetensors file, or a torch
    state-dict file. Each rank reads only what it holds (Note [Weights streamed in and out]). A PEFT model
    takes its base model's checkpoint (Note [Weight names]). strict=False loads the keys that match and
    leaves the rest (the plan's missing / unexpected list them); mis-shaped keys are always refused.
    """
    m = ModelParts(model)
    plan = src = error = None
    try:
        src = open_weights(source)
        tf = transformers_model(m.module)
        plan = match(m.tensors, {k: src.shape(k) for k in src.names()}, peft_adapters(m.module),
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
    """The masters take the chunks just written; where the file holds more precision than the model, their
    own pieces straight from it (Note [A load of the values held] in loads.py)."""
    opt = m.opt
    opt.load_master_from_model()
    key_of = {id(value): key for value, key in zip(m.values, plan.keys)}
    params = opt.params
    for pc, master in zip(opt.pieces, opt.piece_params):
        key = key_of.get(id(params[pc.param]))
        if key is None or master.dtype == params[pc.param].dtype:
            continue
        if torch.finfo(src.dtype(key)).eps < torch.finfo(params[pc.param].dtype).eps:
            at = opt.layout.params[pc.param].offset
            master.copy_(src.read(key, pc.start - at, pc.end - at, dtype=master.dtype))


# ---------------------------------------------------------------------- out
def whole_values(m: ModelParts):
    """(id of the model's tensor, its whole value) for every tensor of `m` once: the store's members gathered
    bucket by bucket (a collective: every rank walks it to its end; at stage 3 each value a copy), then
    buffers and unmanaged tensors as they are."""
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
    """Writes a model's whole weights as a Hugging Face folder at `dest` on every rank (a collective).

    safetensors shards of at most `max_shard_size` with model.safetensors.index.json (one model.safetensors
    when it fits), the module's own state-dict names, tied weights once; with `config` a transformers
    model's config.json (and generation_config.json) beside them, as save_pretrained writes them. Streamed
    (Note [Weights streamed in and out]): no rank holds more than about one bucket beyond its shard. The
    folder appears whole or not at all; an existing `dest` is replaced only once the new one is complete.
    Returns `dest`.
    """
    m = ModelParts(model)
    dest = os.fspath(dest)
    writer = error = None
    if m.rank == 0:
        try:
            entries = [(t.names[0], t.dtype, t.shape) for t in m.tensors]
            writer = WeightWriter(dest, entries, max_shard_size, extra_files=_config_files(m.module) if config else None)
        except Exception as e:  # noqa: BLE001
            error = e
    agree(m.group, error, "save_weights")
    name_of = {id(v): t.names[0] for t, v in zip(m.tensors, m.values)}
    error = None

    def write(value, name):
        nonlocal error
        if writer is not None and error is None:
            try:
                writer.write(name, value.detach().reshape(-1).cpu())
            except Exception as e:  # noqa: BLE001 - the other ranks are still gathering: keep walking
                error = e

    for key, value in whole_values(m):  # a collective: every rank walks it to its end
        write(value, name_of[key])
    if writer is not None:
        try:
            if error is None:
                writer.commit()
        except Exception as e:  # noqa: BLE001
            error = e
        if error is not None:
            writer.abort()
    agree(m.group, error, f"save_weights to {dest}")
    return dest


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
    """Inside, new modules' parameters are on the meta device (no memory) and their buffers real: what a
    stage-3 model is built with (rotary tables and other buffers computed in __init__ keep their values)."""
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
    """`cls.from_pretrained(folder)` for a model no rank can hold: the model built with its parameters on the
    meta device (`cls(config)`, the config read from `folder`, `kwargs` overriding it), its weights loaded
    from `folder` when ShardedDDP takes it (each rank reads only its shards: Note [Weights streamed in and
    out]). At stage 3 only; a PEFT model made from it takes the same weights."""
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
    """The param_init_fn that materialises a from_pretrained model (the file gives the values): nothing for
    the model's own modules, and for a PEFT model's adapters (absent from the file) PEFT's initialisation:
    lora_B (and a LoRA embedding's A) zero, the rest by their reset_parameters() (PEFT's default: lora_A
    kaiming-uniform, as nn.Linear's own)."""
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
