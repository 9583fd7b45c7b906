"""A save's bytes in host memory kept from save to save, and the pure code that writes them to files.

    staging = Staging(alloc)                  # alloc(nbytes) -> a uint8 host tensor (pinned on a GPU)
    staging.begin()
    f = staging.file(path)                    # a record sink, as files.RecordWriter: add(t) -> ref, close()
    ref = f.add(tensor)                       # copies the bytes now; the ref's crc32 comes with the write
    write_staged(f.plan())                    # later, any thread or process: the file written and fsynced

Note [Staging a checkpoint]
---------------------------
A save that does not stop training copies everything it will write (this rank's master values and optimizer
state, rank 0's model state and `extra`) into host memory while training waits, then writes it behind
training's back. The copy is the record file's bytes in file order: each `add` puts a tensor's raw bytes right
after the previous record's, in slabs of SLAB_BYTES (a larger record gets a slab of its own), so the writer
needs no torch and writes each slab's run of records with one request, computing the checksums the manifest
keeps (the same bytes as files.RecordWriter writes, so both saves give the same files). The slabs stay
allocated after the save and are taken again in the same order by the next one: a run whose records keep
their sizes allocates nothing after its first save, and holds about one copy of its checkpoint shard.
"""
from __future__ import annotations

import dataclasses
import os
import zlib

import torch

from shardopt.files import dtype_name

SLAB_BYTES = 64 << 20
WRITE_BYTES = 16 << 20  # one write request at most: the GIL is free meanwhile, memory is not doubled


def host_alloc(pin: bool):
    """alloc(nbytes) for Staging: pageable host memory, or pinned (for copies from a GPU)."""
    def alloc(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return alloc


@dataclasses.dataclass
class FilePlan:
    """What write_staged needs: the file, and its records as (slab memory, offset, nbytes, ref) in file order."""

    path: str
    records: list
    size: int


class StagedFile:
    """A record sink (files.RecordWriter's calls) whose records are copied into the staging slabs."""

    def __init__(self, staging: "Staging", path: str):
        self.staging, self.path = staging, path
        self.records: list = []
        self.size = 0

    def add(self, t: torch.Tensor) -> dict:
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        ref = {"offset": self.size, "nbytes": nbytes, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
               "crc32": zlib.crc32(b"")}
        if nbytes:
            slab, at = self.staging.place(nbytes)
            raw = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
            slab[at:at + nbytes].copy_(raw.view(torch.uint8))
            self.records.append((slab, at, nbytes, ref))
        self.size += nbytes
        return ref

    def close(self) -> dict:
        """The file's manifest entry: its size now, its crc32 once written (write_staged fills it in)."""
        self.entry = {"size": self.size, "crc32": 0}
        return self.entry

    def abort(self) -> None:
        self.records = []

    def plan(self) -> FilePlan:
        return FilePlan(self.path, [(memoryview(s.numpy()), at, n, ref) for s, at, n, ref in self.records],
                        self.size)


class Staging:
    """Slabs of host memory taken in order by one save and kept for the next (Note [Staging a checkpoint])."""

    def __init__(self, alloc):
        self.alloc = alloc
        self.slabs: list[torch.Tensor] = []
        self._slab = self._at = 0

    def begin(self) -> None:
        """A new save: the slabs are taken from the first again (the previous save's writer is done)."""
        self._slab, self._at = -1, 0

    def file(self, path: str) -> StagedFile:
        return StagedFile(self, path)

    def place(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """Where the next record of nbytes goes: (slab, byte offset)."""
        if self._slab >= 0 and self._at + nbytes <= self.slabs[self._slab].numel():
            at = self._at
        else:
            self._slab += 1
            want = max(SLAB_BYTES, nbytes)
            if self._slab == len(self.slabs):
                self.slabs.append(self.alloc(want))
            elif self.slabs[self._slab].numel() < want:
                self.slabs[self._slab] = self.alloc(want)
            at = 0
        self._at = at + nbytes
        return self.slabs[self._slab], at

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slabs)


# ---------------------------------------------------------------- the writer's side: no torch below
def write_all(fd: int, view: memoryview) -> None:
    """Writes all of `view` at the file's position, in requests of at most WRITE_BYTES."""
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:done + WRITE_BYTES])


def write_staged(plan: FilePlan) -> dict:
    """Writes one staged file, fsyncs it and drops it from the page cache; fills in each record's crc32;
    returns {"size", "crc32"} (its manifest entry's)."""
    fd = os.open(plan.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    crc, run = 0, None
    try:
        for mem, at, nbytes, ref in plan.records:
            data = mem[at:at + nbytes]
            ref["crc32"] = zlib.crc32(data)
            crc = zlib.crc32(data, crc)
            # Records that follow each other in a slab go out as one request.
            if run is not None and run[0] is mem and run[2] == at:
                run[2] = at + nbytes
            else:
                if run is not None:
                    write_all(fd, run[0][run[1]:run[2]])
                run = [mem, at, at + nbytes]
        if run is not None:
            write_all(fd, run[0][run[1]:run[2]])
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):  # written and durable: its pages need not stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return {"size": plan.size, "crc32": crc}
