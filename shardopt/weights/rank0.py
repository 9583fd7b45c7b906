"""A whole state dict on rank 0 only, gathered bucket by bucket, its values in file pages: for the APIs that
take a state-dict object (Lightning's weights-only checkpoint file, integrations/lightning.py).

Note [A state dict on rank 0, streamed and spilled]
---------------------------------------------------
Lightning hands its CheckpointIO a dict holding every tensor, so the dict must exist; its values need not
be anonymous memory. Every rank walks the store's members bucket by bucket as save_weights does
(`whole_values`), and rank 0 writes each value to an unlinked scratch file as it arrives and maps it back
privately (`Spill`): pages the kernel reads in when torch.save reads them and may drop again, never swap.
Other ranks hold one bucket beyond their shard; rank 0 one bucket of anonymous memory plus the scratch
file (the model's size, freed with the dict). Tied weights are one tensor under each key, as in
module.state_dict(): torch.save writes it once.
"""
from __future__ import annotations

import mmap
import os
import tempfile

import torch

from shardopt.files import fsync_dir
from shardopt.weights.format import bytes_of, packed_flat, pwrite_all
from shardopt.weights.stream import agree, ModelParts, whole_values


class Spill:
    """Tensors kept in an unlinked scratch file, each mapped back copy-on-write (Note [A state dict on rank 0,
    streamed and spilled]). One mapping per tensor (a model has far fewer tensors than vm.max_map_count)."""

    def __init__(self, directory: str | None = None):
        fd, name = tempfile.mkstemp(dir=directory, prefix=".shardopt-spill-")
        os.unlink(name)  # named first (not O_TMPFILE), so that /proc/<pid>/maps says whose pages these are
        self.file = os.fdopen(fd, "w+b")
        self.end = 0

    def keep(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of `value` (on the CPU) whose memory is pages of the scratch file."""
        flat = packed_flat(value)
        nbytes = flat.numel() * flat.element_size()
        if nbytes == 0:
            return torch.empty(value.shape, dtype=value.dtype)
        at = self.end
        pwrite_all(self.file.fileno(), bytes_of(flat), at)
        self.end = at + -(-nbytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY  # map offsets align
        pages = mmap.mmap(self.file.fileno(), nbytes, offset=at, access=mmap.ACCESS_COPY)
        return torch.frombuffer(pages, dtype=value.dtype).view(value.shape)  # the tensor keeps the mapping

    def close(self) -> None:
        """The file's name is gone already; its space returns once the last tensor mapping it is freed."""
        self.file.close()


def state_dict_on_rank0(model, spill_dir: str | None = None) -> dict | None:
    """`model`'s state dict (every key in order, tied keys one tensor, CPU tensors) on rank 0, None on the other
    ranks; a collective. `model` is a ShardedDDP (or the module it wraps). The values are spilled to a scratch
    file in `spill_dir` (default: the system's temporary folder): Note [A state dict on rank 0, streamed and
    spilled]."""
    m = ModelParts(model)
    spill = error = None
    if m.rank == 0:
        try:
            spill = Spill(spill_dir)
        except Exception as e:  # noqa: BLE001 - every rank still walks the buckets, then learns of it
            error = e
    kept = {}
    for key, value in whole_values(m):
        if spill is not None and error is None:
            try:
                kept[key] = spill.keep(value)
            except Exception as e:  # noqa: BLE001 - the other ranks are still gathering: keep walking
                error = e
    if spill is not None:
        spill.close()
    agree(m.group, error, "gathering the state dict on rank 0")
    if m.rank != 0:
        return None
    return {k: kept[id(v)] for k, v in m.module.state_dict(keep_vars=True).items()}


def torch_save_atomic(obj, path: str) -> None:
    """torch.save straight into a file beside `path` (no copy of the file in memory), made durable, then put
    at `path` by rename: a crash leaves the previous file or none, never half of one."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial-{os.getpid()}")
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))
