"""`python -m shardopt convert CKPT OUT.pt`: a sharded checkpoint as one plain torch file, offline.

CKPT may also be a DeepSpeed ZeRO-1/2 or ZeRO-3 checkpoint folder (shardopt/checkpoint/deepspeed_reader.py,
deepspeed_zero3.py): its fp32 masters and Adam state come out in the same format.

The output is {"model": the model's state_dict (every key, tied names included,
in the model's order and dtype), "optimizer": a torch.optim state dict as
ShardedOptimizer.state_dict() gives after consolidate_state_dict(), "extra": the
user's extra}; `model.load_state_dict(out["model"])` and
`torch.optim.AdamW(model.parameters(), ...).load_state_dict(out["optimizer"])`
continue training on one process. Needs no process group; reads and verifies
every file of the checkpoint.
"""
from __future__ import annotations

import io
import os

import torch

from shardopt.checkpoint.save_load import MODEL_FILE, read_chunk, read_extra, resolve_checkpoint_dir
from shardopt.checkpoint.source import PARAM
from shardopt.checkpoint.files import MANIFEST, RecordReader, atomic_write_bytes, from_json, parse_dtype, read_manifest
from shardopt.checkpoint.pieces import assemble


def checkpoint_to_torch(path, tag: str | None = None, weights_only: bool = True) -> dict:
    """The checkpoint at `path` (see load_checkpoint) as {"model", "optimizer", "extra"} (module docstring)."""
    directory = resolve_checkpoint_dir(path, tag)
    if not os.path.exists(os.path.join(directory, MANIFEST)):
        from shardopt.checkpoint import deepspeed_reader, deepspeed_zero3

        if deepspeed_reader.looks_like_deepspeed(directory):
            return deepspeed_zero3.to_torch(directory, weights_only)
    body = read_manifest(directory)
    reader = RecordReader(directory, body["files"])
    try:
        for name in body["files"]:
            reader.verify_file(name)
        chunks = [read_chunk(reader, file, p) for file, entry in body["files"].items()
                  for p in entry.get("pieces", ())]
        full = assemble({n: tuple(v["shape"]) for n, v in body["params"].items()}, chunks)
        others = {n: reader.read(MODEL_FILE, v["tensor"]) for n, v in body["model_state"].items()}
        extra = read_extra(reader, body, weights_only)
    finally:
        reader.close()

    model_dtype = parse_dtype(body["dtypes"]["model"])
    by_name = {}
    for name, v in body["params"].items():
        # An empty parameter has no pieces, so no chunk: nothing to read.
        state = full.setdefault(name, {PARAM: torch.empty(v["shape"])})
        by_name[name] = state.pop(PARAM).to(model_dtype)
        for alias in body["params"][name]["aliases"]:
            by_name[alias] = by_name[name]  # the same tensor: torch.save keeps the tie
    for name, t in others.items():
        by_name[name] = t
        for alias in body["model_state"][name]["aliases"]:
            by_name[alias] = t
    model = {k: by_name[k] for k in body["state_dict_keys"]}

    # torch.optim numbering: parameters in group order, the first occurrence of each counted.
    index, groups, state = {}, [], {}
    for g in body["param_groups"]:
        ids = []
        for n in g["params"]:
            key = n if n is not None else object()  # not in the model: its own index, no state
            index.setdefault(key, len(index))
            ids.append(index[key])
        groups.append(dict(from_json(g["hyper"]), params=ids))
    for name, st in full.items():
        if st:
            state[index[name]] = st
    return {"model": model, "optimizer": {"state": dict(sorted(state.items())), "param_groups": groups},
            "extra": extra}


def convert(path, out, tag: str | None = None, weights_only: bool = True) -> None:
    """Writes checkpoint_to_torch(path, tag) to `out` atomically."""
    buf = io.BytesIO()
    torch.save(checkpoint_to_torch(path, tag, weights_only), buf)
    atomic_write_bytes(os.fspath(out), buf.getvalue())


def add_parser(sub) -> None:
    """Registers the `convert` subcommand on an argparse subparsers object."""
    c = sub.add_parser("convert", help="a checkpoint directory -> one torch file (model + torch.optim state)")
    c.add_argument("checkpoint", help="the directory given to save_checkpoint (or to DeepSpeed's engine.save_checkpoint), or one of its tag directories")
    c.add_argument("out", help="output file (torch.save format)")
    c.add_argument("--tag", default=None, help="which checkpoint in CHECKPOINT (default: its latest)")
    c.add_argument("--trust-extra", action="store_true",
                   help="unpickle any object in the checkpoint's `extra` (only for checkpoints you trust)")
    c.set_defaults(run=run)


def run(args) -> int:
    import sys

    from shardopt.checkpoint.files import CheckpointError

    try:
        convert(args.checkpoint, args.out, args.tag, weights_only=not args.trust_extra)
    except CheckpointError as e:
        print(f"shardopt convert: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0
