"""`python -m shardopt convert CKPT OUT`: a sharded checkpoint as whole weights, offline.

OUT (or `--format`) decides what is written:
  * a folder (an existing one, a trailing "/", or no .pt/.pth/.bin suffix): the folder save_weights writes,
    streamed one saved piece at a time (hf_convert.py), with the model's config.json beside when found;
  * a .pt/.pth/.bin file: {"model": the model's state_dict, "optimizer": the torch.optim state dict
    consolidate_state_dict gives, "extra"}, for one process to continue with plain torch; built whole in
    memory after every file is verified.
CKPT may be a DeepSpeed ZeRO-1/2/3 folder too. Needs no process group.
"""
from __future__ import annotations

import io
import os

import torch

from shardopt.checkpoint.save_load import MODEL_FILE, read_chunk, read_extra, resolve_checkpoint_dir
from shardopt.checkpoint.source import PARAM
from shardopt.files import MANIFEST, RecordReader, atomic_write_bytes, from_json, parse_dtype, read_manifest
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
        state = full.setdefault(name, {PARAM: torch.empty(v["shape"])})  # an empty one has no pieces
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


TORCH_SUFFIXES = (".pt", ".pth", ".bin")  # an output name ending so is one torch file, anything else a folder


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

    from shardopt.files import CheckpointError
    from shardopt.weights.format import WeightFileError

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
