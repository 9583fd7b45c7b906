"""`shardopt convert CKPT DIR`: a checkpoint's whole weights as a Hugging Face safetensors folder, streamed.

    python -m shardopt convert ckpt out/                       # shardopt's checkpoint, any stage / world size
    python -m shardopt convert ds_ckpt out/ --dtype master     # DeepSpeed ZeRO-1/2/3: zero_to_fp32's job

Note [Whole weights from a checkpoint, one piece at a time]
-----------------------------------------------------------
Checkpoints keep masters as pieces by (name, element range) (Note [Checkpoint layout]), frozen tensors whole,
and safetensors headers are known before any value (Note [Safetensors written in pieces] in
weights/format.py), so each piece is written where it belongs as it is read: (1) the saved model's tensors
once each, in state-dict order under their first key (save_weights' entries and files); (2) each saved piece
of masters (`Source.masters`) at its offset, cast, each frozen tensor whole; (3) commit: the writer refuses
a hole or a double write, and the folder appears whole or not at all (Note [Replacing a folder]). At most
one piece or frozen tensor is in memory. dtype "model" rounds the masters to the model's dtype, as training
does; "master" keeps their precision (zero_to_fp32's output); a torch dtype casts every float tensor.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from shardopt.files import CheckpointError
from shardopt.checkpoint.save_load import open_source
from shardopt.weights.format import SAFE_INDEX, SAFE_WEIGHTS
from shardopt.weights.writer import WeightWriter, parse_size

CONFIG_FILES = ("config.json", "generation_config.json")  # save_pretrained's, copied along when found
DTYPES = ("model", "master", "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the output: its name, where the checkpoint keeps it, and how it is written."""

    name: str  # its first state-dict key, as save_weights writes it
    saved: str  # its name in `Source.params` or `Source.model_state`
    trainable: bool
    dtype: torch.dtype
    shape: tuple


def plan(src, dtype: str = "model") -> list:
    """The output's entries, in the saved model's state-dict order (the Note's step 1)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    seen, out = set(), []
    for key, saved in src.state_dict_names():
        if saved in seen:
            continue  # a tied weight's later key
        seen.add(saved)
        trainable = saved in src.params
        shape = tuple(src.params[saved]["shape"]) if trainable else tuple(src.model_state[saved][1])
        out.append(Entry(key, saved, trainable, _out_dtype(src, saved, trainable, dtype), shape))
    return out


def _out_dtype(src, saved: str, trainable: bool, choice: str) -> torch.dtype:
    held = src.model_dtype(saved)
    if choice == "model" or not held.is_floating_point:
        return held
    if choice == "master":
        return (src.master_dtype() or held) if trainable else held
    return getattr(torch, choice)


def write_values(src, writer: WeightWriter, entries: list) -> None:
    """Every entry's values into `writer`, one saved piece at a time (step 2)."""
    for e in entries:
        if e.trainable:
            for lo, _, values in src.masters(e.saved):
                writer.write(e.name, values.to(e.dtype), lo)
        else:
            writer.write(e.name, src.model_tensor(e.saved).to(e.dtype))


def find_config(directory: str) -> str | None:
    """The folder holding config.json: the tag folder, its parent, or the one above (a Trainer's checkpoint-N)."""
    here = os.path.abspath(directory)
    for folder in (here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    return None


def config_files(config: str | None) -> dict:
    """{file name: bytes} to write beside the weights, from a config.json file or a folder holding one."""
    if config is None:
        return {}
    folder = os.path.dirname(config) if os.path.isfile(config) else config
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise CheckpointError(f"no config.json at {config}: pass a model's config.json or the folder holding it")
    out = {}
    for name in CONFIG_FILES:
        path = config if name == "config.json" and os.path.isfile(config) else os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def _refuse_replacing(dest: str) -> None:
    """Converting replaces an earlier output at `dest`; anything else there is refused (nothing written)."""
    if not os.path.lexists(dest):
        return
    if not os.path.isdir(dest):
        raise CheckpointError(f"{dest} exists and is not a folder: pass a new path (or a .pt file name for one "
                              "torch file)")
    names = set(os.listdir(dest))
    if names and not names & {SAFE_WEIGHTS, SAFE_INDEX}:
        raise CheckpointError(f"{dest} is a folder that holds no model weights ({len(names)} entries): converting "
                              "would replace it; pass a new or empty folder, or a Hugging Face weights folder to "
                              "replace")


def checkpoint_to_hf(path, dest, tag: str | None = None, *, dtype: str = "model", max_shard_size="5GB",
                     config="auto", weights_only: bool = True) -> dict:
    """The whole weights of the checkpoint at `path` as a safetensors folder at `dest` (the Note). `config`: a
    config.json or its folder, None, or "auto" (find_config). Returns {"dest", "tensors", "config"}."""
    dest = os.path.abspath(os.fspath(dest))
    _refuse_replacing(dest)
    src = open_source(path, tag, weights_only)
    try:
        if config == "auto":
            config = find_config(src.directory)
        entries = plan(src, dtype)
        writer = WeightWriter(dest, [(e.name, e.dtype, e.shape) for e in entries], max_shard_size,
                              extra_files=config_files(config))
        with writer:  # an exception aborts: dest stays as it was
            write_values(src, writer, entries)
    finally:
        src.close()
    return {"dest": dest, "tensors": len(entries), "config": config}


def dtype_choice(text: str) -> str:
    """--dtype's argparse type: "model", "master" or a torch dtype name (fp32, bf16, fp16 and their long names)."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}
    choice = aliases.get(text.lower(), text.lower())
    if choice not in DTYPES:
        raise argparse.ArgumentTypeError(f"not a dtype choice: {text!r} (model, master, fp32, bf16 or fp16)")
    return choice


def size_choice(text: str) -> int:
    """--max-shard-size's argparse type: bytes, or a number and a unit ("5GB", "500MB", "2GiB")."""
    try:
        return parse_size(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
