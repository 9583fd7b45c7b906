"""Sharded checkpoints that load at any world size, and torch.optim-format state dicts.

    shardopt.save_checkpoint("ckpt", model, opt, extra={"step": step, "sched": sched.state_dict()})
    extra = shardopt.load_checkpoint("ckpt", model, opt)       # any world size / buckets / stage
    opt.consolidate_state_dict(to=0); full = opt.state_dict()  # torch.optim format, on rank 0
    python -m shardopt convert ckpt out.pt                     # one file: model + torch.optim state

Note [Checkpoint layout]
------------------------
    ckpt/                       the `path` given to save_checkpoint
      latest                    text: the tag of the newest complete checkpoint (replaced last)
      ckpt-000001/              one complete checkpoint (a "tag"; save_checkpoint(tag=...) names it)
        manifest.json           written last; everything needed to interpret the rest, with checksums
        rank-00000.bin          rank 0's pieces: master values and optimizer state, as record files
        rank-00001.bin          ...one per rank of the world that saved
        hop-residual-r000-s00000.bin   int8 hop only: each rank's error-feedback residual
                                (every replica's; Note [Hop residual in checkpoints] in checkpoint/hop_residual.py)
        model.bin               frozen parameters and buffers (rank 0; every rank holds them anyway)
        extra.pt                the user's `extra` (torch.save), if any
      .partial-ckpt-000002/     a save in progress, or one that crashed (ignored; removed on retry)

Pieces are keyed by parameter *name* and element range, never by "rank k's slice": a rank at any world size,
bucket size or stage reads only the records overlapping its pieces. Masters are saved (fp32 for a bf16 model),
so precision and offload may change too. Every reader is a `Source` (this format, DeepSpeed's folders).
Crash safety: ranks write into `.partial-<tag>/` (fsynced, on a file system every rank sees); rank 0 writes
the manifest, renames it to `<tag>/`, then replaces `latest`. A bad checkpoint changes nothing: every rank
verifies what it reads and stages the optimizer state reversibly; only if all succeeded do they install it.
"""
from __future__ import annotations

import dataclasses
import io
import os
import shutil
import time

import torch
import torch.distributed as dist
from torch import nn

from shardopt.checkpoint import background, hop_residual
from shardopt.checkpoint.commit import commit, on_rank0, prepare_dir
from shardopt.files import (LATEST, MANIFEST, CheckpointError, RecordReader, RecordWriter, dtype_name, from_json,
                            parse_dtype, read_manifest, to_json)
from shardopt.checkpoint.pieces import (Chunk, InnerStateSwap, cut, group_hyper, local_chunks, resolve_hyper,
                                        staged_pieces)
from shardopt.checkpoint.optim_state import forget_consolidated
from shardopt.checkpoint.source import PARAM, SAME_STATE, Source, class_name
from shardopt.parallel.consistency import exchange, first_failure
from shardopt.view import ModelWrapper, OptimizerView, view_of

MODEL_FILE, EXTRA_FILE = "model.bin", "extra.pt"


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a checkpoint needs to know about a model: names and kinds of its tensors."""

    names: tuple[str, ...]  # each managed parameter's, in layout order
    aliases: dict  # name -> other names of the same tensor (tied weights)
    others: dict  # name -> (tensor, "frozen" | "buffer"): model state the optimizer does not manage
    group_names: tuple  # per param group, its parameters' names (None: not in the model)
    keys: tuple[str, ...]  # the model's state_dict keys, in order
    held: dict = dataclasses.field(default_factory=dict)
    """Name -> store member, for `others` the store holds sharded (stage 3's frozen parameters: Note [Frozen
    parameters at stage 3] in zero3/build.py); read with other_values(), written with put_other()."""
    shapes: dict = dataclasses.field(default_factory=dict)  # name -> shape of every `others` entry


def _unwrap(model) -> nn.Module:
    """The model a ShardedDDP wraps (Note [The optimizer's view]: its marker), or `model` itself."""
    return model.module if isinstance(model, ModelWrapper) else model


def _check_pair(model, optimizer) -> OptimizerView:
    """The optimizer's view, once `optimizer` is a ShardedOptimizer and `model` its model (or ShardedDDP)."""
    view = getattr(optimizer, "view", None)
    if not isinstance(view, OptimizerView):
        raise TypeError(f"expected a shardopt.ShardedOptimizer, got {type(optimizer).__name__}; for a plain "
                        "torch optimizer use torch.save(model.state_dict()) / optimizer.state_dict()")
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected the model (a ShardedDDP or the module it wraps), got {type(model).__name__}")
    if isinstance(model, ModelWrapper) and model.optimizer is not optimizer:
        raise ValueError("this ShardedDDP wraps a different ShardedOptimizer than the one given: pass the pair "
                         "that trains together")
    return view


def describe_model(module: nn.Module, opt) -> ModelInfo:
    """Names every tensor of `module` for `opt` (a ShardedOptimizer or its view)."""
    opt = view_of(opt)
    by_id: dict = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    names = []
    for j, p in enumerate(opt.params):
        if id(p) not in by_id:
            raise ValueError(f"optimizer parameter {j} (shape {tuple(p.shape)}) is not a parameter of this "
                             "model: pass the model the optimizer was built from")
        names.append(by_id[id(p)][0])
    aliases = {ns[0]: ns[1:] for ns in by_id.values()}
    managed = {id(p) for p in opt.params}
    others, seen = {}, {}
    state = module.state_dict(keep_vars=True)
    for k, v in state.items():
        if not torch.is_tensor(v):
            raise CheckpointError(f"model state {k!r} is not a tensor (module extra state): save it in `extra`")
        if id(v) in managed:
            continue
        if id(v) in seen:
            aliases.setdefault(seen[id(v)], []).append(k)
            continue
        seen[id(v)] = k
        aliases.setdefault(k, [])
        others[k] = (v, "frozen" if isinstance(v, nn.Parameter) else "buffer")
    group_names = tuple(tuple(by_id[id(p)][0] if id(p) in by_id else None for p in g["params"])
                        for g in opt.param_groups)
    members = {id(p): i for i, p in enumerate(opt.store.members)}
    held = {k: members[id(t)] for k, (t, _) in others.items() if id(t) in members}
    shapes = {k: tuple(opt.store.layout.params[held[k]].shape) if k in held else tuple(t.shape)
              for k, (t, _) in others.items()}
    return ModelInfo(names=tuple(names), aliases={k: list(v) for k, v in aliases.items()}, others=others,
                     group_names=group_names, keys=tuple(state), held=held, shapes=shapes)


def other_values(opt, info: ModelInfo):
    """(name, value) of every `others` entry, held ones gathered bucket by bucket (a collective); each valid until
    the next."""
    held = {i: k for k, i in info.held.items()}
    for i, value in opt.store.stream(sorted(held)):
        yield held[i], value
    for k, (t, _) in info.others.items():
        if k not in info.held:
            yield k, t


def keep_other(opt, info: ModelInfo, name: str, values: torch.Tensor):
    """What a load keeps of a frozen parameter or buffer until put_other: the value, or of a held one this
    rank's parts, copied, so that a load holds at most one whole frozen tensor beyond its shard."""
    i = info.held.get(name)
    if i is None:
        return values
    flat = values.reshape(-1)
    return [flat[lo:hi].clone() for lo, hi, _ in opt.store.local_parts(i)]


@torch.no_grad()
def put_other(opt, info: ModelInfo, name: str, values) -> None:
    """A loaded frozen parameter or buffer into the model (a held one: this rank's parts)."""
    i = info.held.get(name)
    if i is None:
        info.others[name][0].copy_(values)
        return
    parts = opt.store.local_parts(i)
    if isinstance(values, list):
        for (_, _, view), part in zip(parts, values, strict=True):
            view.copy_(part)
        return
    flat = values.reshape(-1)
    for lo, hi, view in parts:
        view.copy_(flat[lo:hi])


def _agree(opt, error: BaseException | None) -> None:
    """Raises on every rank if `error` is set on any rank (so no rank goes on into a collective alone)."""
    failed = first_failure(error, opt.world_group)  # every replica too (Note [Hybrid sharding])
    if failed:
        r, m = failed
        raise CheckpointError(f"rank {r} failed, so every rank stops (nothing was changed here): {m}")


def _agree_or_undo(opt, error: BaseException | None, swap) -> None:
    """_agree, restoring the optimizer's swapped-out state first when any rank failed."""
    try:
        _agree(opt, error)
    except BaseException:
        swap.undo()
        raise


def _write_rank_file(partial: str, opt, info: ModelInfo, sink) -> tuple[str, dict, list]:
    name = f"rank-{opt.rank:05d}.bin"
    w = sink(os.path.join(partial, name))
    pieces, steps = [], set()
    try:
        for i, c in local_chunks(opt, info.names, copy=False):
            pieces.append({
                "name": c.key, "start": c.start, "end": c.end, "param": w.add(opt.piece_params[i]),
                "slices": {k: w.add(v) for k, v in c.slices.items()},
                "scalars": {k: {"tensor": w.add(v)} if torch.is_tensor(v) else {"value": to_json(v, k)}
                            for k, v in c.scalars.items()}})
            if "step" in c.scalars:
                steps.add(float(c.scalars["step"]))
    except BaseException:
        w.abort()
        raise
    entry = w.close()
    entry["pieces"] = pieces
    return name, entry, sorted(steps)


def _write_model_state(partial: str, opt, info: ModelInfo, sink) -> dict | None:
    """Frozen parameters and buffers, written by rank 0; every rank walks other_values() (a collective) anyway."""
    w = error = None
    if opt.rank == 0:
        try:
            w = sink(os.path.join(partial, MODEL_FILE))
        except Exception as e:  # noqa: BLE001 - raised after the walk
            error = e
    model_state = {}
    for k, t in other_values(opt, info):
        if w is not None and error is None:
            try:
                model_state[k] = {"kind": info.others[k][1], "tensor": w.add(t)}
            except Exception as e:  # noqa: BLE001 - the other ranks are still gathering: keep walking
                error = e
    if error is not None:
        if w is not None:
            w.abort()
        raise error
    if w is None:
        return None
    return {"model_state": {k: model_state[k] for k in info.others}, "files": {MODEL_FILE: w.close()}}


def _write_rank0_files(partial: str, written: dict, extra, sink) -> dict:
    """The model state written (_write_model_state) and `extra`: what only rank 0 writes."""
    out = {"model_state": written["model_state"], "files": dict(written["files"]), "extra": None}
    if extra is not None:
        buf = io.BytesIO()
        torch.save(extra, buf)
        w = sink(os.path.join(partial, EXTRA_FILE))
        out["extra"] = w.add(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
        out["files"][EXTRA_FILE] = w.close()
    return out


def _manifest_head(opt, info: ModelInfo) -> dict:
    """What the manifest says of the model and the optimizer as they are now, at the start of a save."""
    scaler = opt.loss_scaler
    layout = opt.layout
    return {
        "created": time.time(), "torch": torch.__version__,
        "world_size": opt.world_size, "stage": opt.config.stage,
        "mesh": [opt.sharding.shape.replicas, opt.sharding.shape.shards],
        "config": {f.name: repr(getattr(opt.config, f.name)) for f in dataclasses.fields(opt.config)},
        "optimizer": class_name(opt.optim_class),
        "dtypes": {"model": dtype_name(opt.params[0].dtype), "master": None},
        "layout": {"bucket_numel": layout.bucket_numel, "total_numel": layout.total_numel,
                   "buckets": [[b.group, b.start, b.numel] for b in layout.buckets],
                   "params": [[info.names[s.index], list(s.shape), s.group, s.offset] for s in layout.params]},
        "params": {info.names[s.index]: {"shape": list(s.shape), "group": s.group,
                                         "aliases": info.aliases.get(info.names[s.index], [])}
                   for s in layout.params},
        "state_dict_keys": list(info.keys),
        "param_groups": [{"hyper": to_json(group_hyper(g), f"param_groups[{i}]"), "params": list(info.group_names[i])}
                         for i, g in enumerate(opt.param_groups)],
        "loss_scaler": to_json(scaler.state_dict(), "loss scaler state") if scaler is not None else None,
        "onebit": opt.onebit.record() if opt.onebit is not None else None,
    }


def _manifest(head: dict, info: ModelInfo, everyone: list) -> dict:
    """The manifest body: `head`, and what every rank wrote (everyone[r]: rank r's part)."""
    rank0 = everyone[0]["rank0"]
    files = dict(rank0["files"])
    for m in everyone:
        files.update(m["files"])
    master = next((p["param"]["dtype"] for f in files.values() for p in f.get("pieces", ())), None)
    return dict(head, dtypes=dict(head["dtypes"], master=master),
                model_state={k: dict(v, aliases=info.aliases.get(k, [])) for k, v in rank0["model_state"].items()},
                steps=sorted({s for m in everyone for s in m["steps"]}), extra=rank0["extra"], files=files)


def save_checkpoint(path, model, optimizer, extra=None, *, tag: str | None = None, blocking: bool = True):
    """Saves model + optimizer into `path/<tag>/` (default: the next ckpt-NNNNNN), then points `path/latest` at
    it; returns it. A collective; atomic (Note [Checkpoint layout]). `extra`: rank 0's, anything torch.save stores.

    blocking=False returns once this rank's part is copied to host memory, as an AsyncSave whose result() is the
    folder; a background thread writes it (Note [Checkpoints written behind training] in background.py).
    """
    opt = _check_pair(model, optimizer)
    background.settle(opt)  # a save in flight first: one at a time, its failure raised here on every rank
    opt.wait_params()  # parameters may still be gathered (Note [Gathering in the next forward])
    opt.take_model_edits(saving=True)  # the masters saved hold edited weights (Note [Weights edited in place])
    path = os.fspath(path)
    sharding = opt.sharding
    residual = hop_residual.live(opt)  # OneBitAdam's or the int8 hop's (Note [Hop residual in checkpoints])
    if not blocking:
        if sharding.shape.hybrid:
            raise NotImplementedError("save_checkpoint(blocking=False) on a hybrid mesh (replicas) is not built: "
                                      "pass blocking=True")
        try:
            saver = background.saver_of(opt)
            written = _write(path, model, opt, extra, tag, hop_residual.write_own(opt, residual)
                             if residual is not None else None, saver.sink())
        except RuntimeError as e:
            named = background.lost_while_staging(opt, path, e)
            if named is None:
                raise
            raise named from e
        return saver.start(written, lambda everyone: _commit(written, everyone))
    if not sharding.shape.hybrid:
        return _save(path, model, opt, extra, tag, hop_residual.write_own(opt, residual) if residual is not None
                     else None)
    # Hybrid: the first replica writes it, the others add their residuals (Note [Hop residual in checkpoints]).
    out = [None]
    if sharding.replica == 0:
        share = hop_residual.Share(opt, residual) if residual is not None else None
        try:
            out = [("ok", _save(path, model, opt, extra, tag, share))]
        except Exception as e:  # noqa: BLE001 - the other replicas must learn of it
            out = [("error", f"{type(e).__name__}: {e}")]
        finally:
            if share is not None:
                share.abandon()  # the peers wait for a directory: tell them there is none
    elif residual is not None:
        hop_residual.contribute(opt, residual)
    dist.broadcast_object_list(out, group=sharding.replicate, group_src=0)
    status, value = out[0]
    if status == "error":
        if sharding.replica == 0:
            raise CheckpointError(value)
        raise CheckpointError(f"the first replica failed to save: {value}")
    return value


@dataclasses.dataclass
class Written:
    """One rank's part of a save, written (or staged: `files` are then staging.StagedFile) into `partial`."""

    path: str
    partial: str
    final: str
    tag: str
    info: ModelInfo
    mine: dict  # what rank 0 gathers: {"files", "steps"} (rank 0: and "rank0"), or {"error"}
    head: dict | None  # rank 0: the manifest's head (_manifest_head), taken with the values
    files: list  # the record sinks written to, in order
    me: str  # this rank, as errors name it


def _write(path: str, model, opt, extra, tag: str | None, share, sink) -> Written:
    """This rank's part of a save over one shard group, through `sink(file) -> a record writer`; `share(directory)`:
    the residual files written into it."""
    info = describe_model(_unwrap(model), opt)
    # Errors are raised on the shard group's rank 0: name this rank as the launcher does too.
    me = f"rank {opt.rank}" + (f" (global rank {dist.get_rank()})" if dist.get_rank() != opt.rank else "")
    partial, final, tag = on_rank0(opt.process_group, lambda: prepare_dir(path, tag))
    files = []

    def opened(file):
        files.append(sink(file))
        return files[-1]

    head = None
    try:
        others = share(partial) if share is not None else {}
        name, entry, steps = _write_rank_file(partial, opt, info, opened)
        mine = {"files": {name: entry, **others}, "steps": steps}
    except Exception as e:  # noqa: BLE001 - rank 0 must learn of it and abandon the save
        mine = {"error": f"{me}: {type(e).__name__}: {e}"}
    try:
        written = _write_model_state(partial, opt, info, opened)  # every rank walks it (stage 3 gathers)
        if opt.rank == 0 and "error" not in mine:
            mine["rank0"] = _write_rank0_files(partial, written, extra, opened)
            head = _manifest_head(opt, info)
    except Exception as e:  # noqa: BLE001 - rank 0 must learn of it and abandon the save
        mine = {"error": f"{me}: {type(e).__name__}: {e}"}
    return Written(path, partial, final, tag, info, mine, head, files, me)


def _commit(w: Written, everyone: list) -> str:
    """Rank 0, every rank's part in hand: the manifest and the rename, or the partial folder removed."""
    try:
        if errors := [m["error"] for m in everyone if "error" in m]:
            raise CheckpointError("; ".join(errors) + f" (nothing was saved; {w.path}/{LATEST} is unchanged)")
        return commit(w.path, w.partial, w.final, w.tag, _manifest(w.head, w.info, everyone))
    except BaseException:
        shutil.rmtree(w.partial, ignore_errors=True)  # gone already if the rename happened
        raise


def _save(path: str, model, opt, extra, tag: str | None, share=None) -> str:
    """save_checkpoint over one shard group, written now."""
    w = _write(path, model, opt, extra, tag, share, lambda file: RecordWriter(file))
    return exchange(opt.process_group, w.mine, lambda everyone: _commit(w, everyone), f"checkpoint {w.final}",
                    CheckpointError)


def resolve_checkpoint_dir(path, tag: str | None = None) -> str:
    """The checkpoint directory meant by `path` (a tag directory, or one with `latest`, as DeepSpeed's) and `tag`."""
    path = os.fspath(path)
    if tag is not None:
        return os.path.join(path, tag)
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    from shardopt.checkpoint.deepspeed_reader import looks_like_deepspeed

    if looks_like_deepspeed(path):  # a DeepSpeed tag folder
        return path
    latest = os.path.join(path, LATEST)
    try:
        with open(latest) as f:
            tag = f.read().strip()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}: it has neither {MANIFEST} nor {LATEST}; pass the "
                              "directory given to save_checkpoint, or a tag directory inside it") from None
    if not tag or "/" in tag:
        raise CheckpointError(f"{latest} is damaged ({tag!r}); pass tag=... to pick a checkpoint in {path}")
    return os.path.join(path, tag)


def read_chunk(reader: RecordReader, file: str, entry: dict) -> Chunk:
    """One saved piece, read and verified: its master values are in slices[PARAM]."""
    slices = {k: reader.read(file, ref) for k, ref in entry["slices"].items()}
    slices[PARAM] = reader.read(file, entry["param"])
    scalars = {k: reader.read(file, v["tensor"]) if "tensor" in v else from_json(v["value"])
               for k, v in entry["scalars"].items()}
    return Chunk(entry["name"], entry["start"], entry["end"], slices, scalars)


def read_extra(reader: RecordReader, body: dict, weights_only: bool = True):
    """The user's `extra` (None if none was saved)."""
    if body["extra"] is None:
        return None
    raw = reader.read(EXTRA_FILE, body["extra"])
    return torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=weights_only)


class NativeSource(Source):
    """A checkpoint written by save_checkpoint (Note [Checkpoint layout])."""

    def __init__(self, directory: str, weights_only: bool):
        self.directory, self.weights_only = directory, weights_only
        self.body = body = read_manifest(directory)
        self.params = body["params"]
        self.model_state = {n: (v["kind"], tuple(v["tensor"]["shape"])) for n, v in body["model_state"].items()}
        self.scaler = from_json(body["loss_scaler"]) if body["loss_scaler"] is not None else None
        # Note [The step the variance froze at] in onebit.py; without the record, known by its residual files.
        legacy = "onebit" not in body and any(
            str(e.get("hop_residual", {}).get("signature", {}).get("format", "")).startswith("onebit")
            for e in body["files"].values())
        self.onebit = body.get("onebit") or ({"legacy": True} if legacy else None)
        self._saved: dict = {}
        for file, entry in body["files"].items():
            for p in entry.get("pieces", ()):
                self._saved.setdefault(p["name"], []).append((file, p))
        for entries in self._saved.values():
            entries.sort(key=lambda fp: fp[1]["start"])
        self._reader = RecordReader(directory, body["files"])
        self._cache: dict = {}  # a saved piece overlapping two of ours is read once
        self._cached: dict = {}  # its key -> (parameter name, end)

    def resolve_hyper(self, opt) -> list:
        saved_cls, cls = self.body["optimizer"], class_name(opt.optim_class)
        same = saved_cls == cls
        if not same and not any({saved_cls, cls} <= s for s in SAME_STATE):
            raise CheckpointError(f"{self.directory} holds {saved_cls} state, this optimizer is {cls}: build the "
                                  "optimizer with the class that saved it")
        return resolve_hyper(opt, [from_json(g["hyper"]) for g in self.body["param_groups"]], same,
                             f"checkpoint {self.directory}")

    def chunks(self, name: str, start: int, end: int) -> list:
        # A parameter's ranges are asked for in increasing order: what ends before `start` is not asked again.
        for key in [k for k, (n, e) in self._cached.items() if n == name and e <= start]:
            del self._cached[key], self._cache[key]
        out = []
        for file, p in self._saved.get(name, ()):
            if p["start"] < end and p["end"] > start:
                key = (file, p["param"]["offset"])
                if key not in self._cache:
                    self._cache[key] = read_chunk(self._reader, file, p)
                    self._cached[key] = (name, p["end"])
                out.append(self._cache[key])
        return out

    def model_tensor(self, name: str) -> torch.Tensor:
        return self._reader.read(MODEL_FILE, self.body["model_state"][name]["tensor"])

    def masters(self, name: str):
        for file, p in self._saved.get(name, ()):  # sorted by start; read one by one, not cached
            yield p["start"], p["end"], self._reader.read(file, p["param"])

    def state_dict_names(self) -> list:
        primary = {alias: n for part in ("params", "model_state") for n, v in self.body[part].items()
                   for alias in [n, *v["aliases"]]}
        return [(k, primary[k]) for k in self.body["state_dict_keys"]]

    def model_dtype(self, name: str) -> torch.dtype:
        if name in self.params:
            return parse_dtype(self.body["dtypes"]["model"])
        return parse_dtype(self.body["model_state"][name]["tensor"]["dtype"])

    def master_dtype(self) -> torch.dtype | None:
        master = self.body["dtypes"]["master"]
        return parse_dtype(master) if master is not None else None

    def extra(self):
        return read_extra(self._reader, self.body, self.weights_only)

    def _residual_entries(self):
        return [(file, e["hop_residual"]) for file, e in self.body["files"].items() if "hop_residual" in e]

    def hop_residual_signature(self):
        entries = self._residual_entries()
        return entries[0][1]["signature"] if entries else None

    def hop_residual(self, replica: int, shard: int):
        for file, h in self._residual_entries():
            if (h["replica"], h["shard"]) == (replica, shard):
                return self._reader.read(file, h["ref"])
        return None

    def close(self) -> None:
        self._cache.clear()
        self._cached.clear()
        self._reader.close()


def open_source(path, tag: str | None = None, weights_only: bool = True) -> Source:
    """The checkpoint at `path` (shardopt's, or a DeepSpeed ZeRO-1/2/3 folder) as a Source."""
    directory = resolve_checkpoint_dir(path, tag)
    if not os.path.exists(os.path.join(directory, MANIFEST)):
        from shardopt.checkpoint import deepspeed_reader, deepspeed_zero3

        if deepspeed_reader.looks_like_deepspeed(directory):
            return deepspeed_zero3.open_deepspeed(directory, weights_only)
    return NativeSource(directory, weights_only)


def _mismatch(src: Source, info: ModelInfo, opt) -> str | None:
    """What differs between the saved model and this one, or None."""
    saved = {n: ("trainable", tuple(v["shape"])) for n, v in src.params.items()}
    saved.update(src.model_state)
    here = {n: ("trainable", tuple(s.shape)) for n, s in zip(info.names, opt.layout.params)}
    here.update({n: (kind, info.shapes[n]) for n, (t, kind) in info.others.items()})

    def some(xs):
        xs = sorted(xs)
        return ", ".join(xs[:10]) + (f" and {len(xs) - 10} more" if len(xs) > 10 else "")

    problems = []
    if missing := set(here) - set(saved):
        problems.append(f"missing from the checkpoint: {some(missing)}")
    if unexpected := set(saved) - set(here):
        problems.append(f"unexpected (in the checkpoint, not in this model): {some(unexpected)}")
    both = set(here) & set(saved)
    if shaped := [f"{n} (checkpoint {list(saved[n][1])}, model {list(here[n][1])})"
                  for n in both if saved[n][1] != here[n][1]]:
        problems.append(f"mis-shaped: {some(shaped)}")
    if kinds := [f"{n} ({saved[n][0]} in the checkpoint, {here[n][0]} here)"
                 for n in both if (saved[n][0] == "trainable") != (here[n][0] == "trainable")]:
        problems.append(f"trainable vs not: {some(kinds)}")
    if not problems:
        groups = [f"{n} (group {src.params[n]['group']} in the checkpoint, {s.group} here)"
                  for n, s in zip(info.names, opt.layout.params) if src.params[n]["group"] != s.group]
        if groups:
            problems.append(f"in another param group: {some(groups)}")
    return "; ".join(problems) or None


@dataclasses.dataclass
class _Staged:
    pieces: object     # pieces.StagedPieces, or the state tier's StagedRecords: master values until install()
    others: dict       # model state name -> tensor
    hyper: list
    scaler: object
    extra: object
    residual: object   # hop_residual.Staged, or None
    onebit: object     # Source.onebit


def _stage(src: Source, opt, info: ModelInfo, swap: InnerStateSwap) -> _Staged:
    """Reads and verifies everything this rank needs; changes nothing but the (undoable) inner state."""
    directory = src.directory
    if problem := _mismatch(src, info, opt):
        raise CheckpointError(f"{directory} is a checkpoint of a different model: {problem}. Build the model "
                              "it was saved from (`python -m shardopt convert` gives plain weights to load "
                              "selectively)")
    hyper = src.resolve_hyper(opt)
    states = {}
    pieces = staged_pieces(opt)  # with the state on disk: written bucket by bucket into a file of their own
    try:
        for i, pc in enumerate(opt.pieces):
            name = info.names[pc.param]
            slot = opt.layout.params[pc.param]
            a, b = pc.start - slot.offset, pc.end - slot.offset
            slices, scalars = cut(src.chunks(name, a, b), a, b, f"parameter {name!r}")
            states[i] = pieces.put(i, slices.pop(PARAM), slices, scalars)
        pieces.finish()
        others = {n: keep_other(opt, info, n, src.model_tensor(n)) for n in src.model_state}
        extra = src.extra()
        residual = hop_residual.stage(src, opt)
        swap.apply(states, hyper)  # last: the only change, and undoable
    except BaseException:
        pieces.discard()
        raise
    return _Staged(pieces, others, hyper, src.scaler, extra, residual, src.onebit)


def load_checkpoint(path, model, optimizer, *, tag: str | None = None, weights_only: bool = True):
    """Loads a checkpoint at any world size, stage and bucket size; returns its `extra`. A collective that
    refuses a damaged checkpoint or another model's on every rank, changing nothing. `path`: as save_checkpoint's
    (its `latest`, or `tag`), a tag directory, or a DeepSpeed folder (`extra`: its client_state and counters)."""
    opt = _check_pair(model, optimizer)
    background.settle(opt)  # a save in flight first (it may be the one to load), its failure raised here
    opt.wait_params()  # the load writes parameters that may still be being gathered
    swap = InnerStateSwap(opt)
    staged = info = error = None
    try:
        if opt.engine is None:
            raise RuntimeError("load_checkpoint needs the model wrapped: build shardopt.ShardedDDP(model, "
                               "optimizer) first, then load (loading ends by all-gathering the weights)")
        info = describe_model(_unwrap(model), opt)
        src = open_source(path, tag, weights_only)
        try:
            staged = _stage(src, opt, info, swap)
        finally:
            src.close()
    except Exception as e:  # noqa: BLE001 - handed to _agree, which raises it on this rank
        error = e
    try:
        _agree_or_undo(opt, error, swap)
    except BaseException:
        if staged is not None:
            staged.pieces.discard()
        raise
    with torch.no_grad():
        for g, h in zip(opt.param_groups, staged.hyper):
            g.update(h)
        staged.pieces.install()
        for name, values in staged.others.items():
            put_other(opt, info, name, values)
    scaler = opt.loss_scaler
    if scaler is not None and staged.scaler is not None:
        scaler.load_state_dict(staged.scaler)
    forget_consolidated(opt)
    opt.zero_grad()  # gradients accumulated before the load belong to other weights
    hop_residual.install(opt, staged.residual)  # or zeros, said once (Note [Hop residual in checkpoints])
    if opt.onebit is not None:
        opt.onebit.after_load(staged.onebit)  # steps taken: from the loaded optimizer state
    opt.publish_params()
    opt.store.after_load()
    return staged.extra
