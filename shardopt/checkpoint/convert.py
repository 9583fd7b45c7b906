"""`python -m shardopt convert CKPT OUT`: a sharded checkpoint as whole weights, offline.

OUT decides what is written (or `--format`):
  * a folder (OUT is an existing folder, ends in "/", or has no .pt/.pth/.bin suffix): the model's whole
    weights as a Hugging Face safetensors folder, the folder `shardopt.save_weights` writes for the same
    model (and `from_pretrained` reads), streamed one saved piece at a time so that the model is never
    whole in memory (checkpoint/hf_convert.py: Note [Whole weights from a checkpoint, one piece at a time]);
    with the model's config.json copied beside when the checkpoint's folders hold one (or `--config`);
  * a torch file (OUT ends in .pt, .pth or .bin): {"model": the model's state_dict (every key, tied names
    included, in the model's order and dtype), "optimizer": a torch.optim state dict as
    ShardedOptimizer.state_dict() gives after consolidate_state_dict(), "extra": the user's extra};
    `model.load_state_dict(out["model"])` and `torch.optim.AdamW(model.parameters(), ...).load_state_dict(
    out["optimizer"])` continue training on one process. Built whole in memory (model and optimizer
    state), and every file of the checkpoint is read and verified.

CKPT may also be a DeepSpeed ZeRO-1/2 or ZeRO-3 checkpoint folder (shardopt/checkpoint/deepspeed_reader.py,
deepspeed_zero3.py): its fp32 masters (and, for the torch file, Adam state) come out the same way; the folder
output is the job of DeepSpeed's zero_to_fp32, at one piece of memory. Needs no process group.
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


TORCH_SUFFIXES = (".pt", ".pth", ".bin")
"""Output names that mean one torch file (as before folders were written); anything else is a folder."""


def output_format(out: str, chosen: str | None) -> str:
    """"hf" or "torch": `chosen` (--format), else from OUT (module docstring)."""
    if chosen is not None:
        return chosen
    if os.path.isdir(out) or out.endswith(("/", os.sep)) or not out.lower().endswith(TORCH_SUFFIXES):
        return "hf"
    return "torch"


def add_parser(sub) -> None:
    """Registers the `convert` subcommand on an argparse subparsers object."""
    from shardopt.checkpoint.hf_convert import dtype_choice, size_choice

    c = sub.add_parser(
        "convert", help="a checkpoint -> whole weights: a Hugging Face safetensors folder (streamed) or one torch "
                        "file (model + torch.optim state)",
        description="Writes a checkpoint's whole weights. OUT a folder (an existing one, a trailing '/', or a name "
                    "without .pt/.pth/.bin): a Hugging Face safetensors folder, as shardopt.save_weights writes it, "
                    "streamed one saved piece at a time (memory: one parameter, whatever the model's size). OUT a "
                    ".pt/.pth/.bin file: one torch file {model, optimizer, extra}, built whole in memory.")
    c.add_argument("checkpoint", help="the directory given to save_checkpoint (or to DeepSpeed's engine.save_checkpoint), or one of its tag directories")
    c.add_argument("out", help="output folder (Hugging Face safetensors) or .pt/.pth/.bin file (torch.save)")
    c.add_argument("--format", choices=("hf", "torch"), default=None,
                   help="what to write, whatever OUT's name: hf (a safetensors folder) or torch (one file)")
    c.add_argument("--tag", default=None, help="which checkpoint in CHECKPOINT (default: its latest)")
    c.add_argument("--dtype", type=dtype_choice, default=None,
                   help="hf only. model (default): each tensor in the dtype the model held it in, as the checkpoint "
                        "records it (trainable parameters: the fp32 masters rounded to it, as training rounds "
                        "them); master: trainable parameters at the saved masters' precision (fp32: DeepSpeed's "
                        "zero_to_fp32 output), the rest as held; fp32, bf16 or fp16: every floating-point tensor "
                        "cast to it")
    c.add_argument("--max-shard-size", type=size_choice, default=None,
                   help="hf only: the largest safetensors file, as save_pretrained's max_shard_size (default 5GB)")
    c.add_argument("--config", default=None,
                   help="hf only: a config.json (or a folder holding one, with its generation_config.json) to copy "
                        "beside the weights; default: the one in the checkpoint's folder, the folder above it or "
                        "the one above that (a Trainer's checkpoint-N), if any; 'none' for none")
    c.add_argument("--trust-extra", action="store_true",
                   help="unpickle any object in the checkpoint's `extra` (only for checkpoints you trust)")
    c.set_defaults(run=run)


def run(args) -> int:
    import sys

    from shardopt.checkpoint.files import CheckpointError
    from shardopt.weights.hf_files import WeightFileError

    fmt = output_format(args.out, args.format)
    try:
        if fmt == "torch":
            given = [f"--{n.replace('_', '-')}" for n in ("dtype", "max_shard_size", "config")
                     if getattr(args, n) is not None]
            if given:
                print(f"shardopt convert: {', '.join(given)} apply to a Hugging Face folder, not to the torch file "
                      f"{args.out} (pass a folder, or --format hf)", file=sys.stderr)
                return 2
            convert(args.checkpoint, args.out, args.tag, weights_only=not args.trust_extra)
            print(f"wrote {args.out}")
            return 0
        from shardopt.checkpoint.hf_convert import checkpoint_to_hf

        config = {None: "auto", "none": None}.get(args.config, args.config)
        done = checkpoint_to_hf(args.checkpoint, args.out, args.tag, dtype=args.dtype or "model",
                                max_shard_size=args.max_shard_size or "5GB", config=config,
                                weights_only=not args.trust_extra)
    except (CheckpointError, WeightFileError) as e:
        print(f"shardopt convert: {e}", file=sys.stderr)
        return 1
    where = f", config from {done['config']}" if done["config"] else ", no config.json (pass --config for one)"
    print(f"wrote {done['tensors']} tensors to {done['dest']}{where}")
    return 0
