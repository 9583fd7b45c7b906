"""A checkpoint's two-phase commit: the partial folder, every rank's part gathered, rank 0's rename.

    partial, final, tag = on_rank0(group, lambda: prepare_dir(path, tag))
    ... every rank writes its files into `partial` ...
    final = exchange(group, mine, lambda everyone: commit(...), what, CheckpointError)   # parallel/consistency.py
"""
from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist

from shardopt.files import (LATEST, MANIFEST, OWNER, CheckpointError, atomic_write_bytes, fsync_dir,
                            manifest_bytes, mark_owner, remove_dead_partials)

DEFAULT_TAG = re.compile(r"ckpt-(\d+)$")
PARTIAL = re.compile(r"^\.partial-.+$")


def prepare_dir(path: str, tag: str | None) -> tuple[str, str, str]:
    """Rank 0: (partial folder, final folder, tag) of a new checkpoint in `path`, the partial folder made."""
    os.makedirs(path, exist_ok=True)
    remove_dead_partials(path, PARTIAL)  # Note [Folders a killed writer leaves] in files.py
    if tag is None:
        used = [int(m.group(1)) for n in os.listdir(path) if (m := DEFAULT_TAG.match(n))]
        tag = f"ckpt-{max(used, default=0) + 1:06d}"
    if not isinstance(tag, str) or not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(f"tag must be a plain directory name (not '{LATEST}', no '/', no leading '.'), "
                         f"got {tag!r}")
    final = os.path.join(path, tag)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists: pass another tag, or delete it first (nothing was "
                              "written)")
    partial = os.path.join(path, f".partial-{tag}")
    if os.path.exists(partial):  # left by a save that crashed
        shutil.rmtree(partial)
    os.makedirs(partial)
    mark_owner(partial)
    return partial, final, tag


def commit(path: str, partial: str, final: str, tag: str, body: dict) -> str:
    """Rank 0: the manifest, the rename, then `latest` (Note [Checkpoint layout] in save_load.py)."""
    os.unlink(os.path.join(partial, OWNER))
    atomic_write_bytes(os.path.join(partial, MANIFEST), manifest_bytes(body))
    os.rename(partial, final)
    fsync_dir(path)
    atomic_write_bytes(os.path.join(path, LATEST), (tag + "\n").encode())
    return final


def _size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def on_rank0(group, fn):
    """Runs fn on rank 0 of `group` and hands its result (or its error) to every rank."""
    world, rank = _size_rank(group)
    out = [None]
    if rank == 0:
        try:
            out = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            out = [("error", f"{type(e).__name__}: {e}")]
    if world > 1:
        dist.broadcast_object_list(out, group=group, group_src=0)
    status, value = out[0]
    if status == "error":
        raise CheckpointError(f"rank 0: {value}")
    return value
