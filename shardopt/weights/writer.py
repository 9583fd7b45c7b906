"""A safetensors folder written in pieces: `WeightWriter(dest, entries)`.

The folder transformers writes for the same tensors (one model.safetensors, or
model-0000i-of-0000N.safetensors + model.safetensors.index.json, split as huggingface_hub splits), laid
out and given its headers up front, so that `write(name, values, lo)` puts any piece of any tensor at its
place, in any order: nothing ever needs a whole model, or a whole tensor, in memory. `commit()` refuses a
hole, then puts the folder at `dest` by rename (Note [Replacing a folder]); until then a previous `dest`
is untouched. The caller casts, names tied weights once, and decides which rank writes what.
"""
from __future__ import annotations

import bisect
import dataclasses
import fractions
import json
import math
import os
import re
import secrets
import shutil
import struct
from typing import Iterable

import torch

from shardopt.files import OWNER, atomic_write_bytes, dtype_name, fsync_dir, mark_owner, remove_dead_partials
from shardopt.weights.format import SAFE_INDEX, SAFE_WEIGHTS, WeightFileError, bytes_of, packed_flat, pwrite_all, \
    safetensors_code


@dataclasses.dataclass(frozen=True)
class WeightEntry:
    """One tensor to write: name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """One safetensors file as planned: its header bytes and where each tensor's element 0 lies."""

    name: str
    header: bytes
    """The 8-byte length, the JSON and its padding: the file's first bytes."""
    starts: dict
    """Tensor name -> byte of its element 0 in the file."""
    size: int
    """The file's length in bytes."""


# ------------------------------------------------------ planning a write
_UNITS = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
          "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(size) -> int:
    """Bytes in `size`: an int, or a number and a unit, decimal as huggingface_hub's ("5GB" = 5 * 10**9) or
    binary ("5GiB" = 5 * 2**30), any case, fractions allowed ("1.5GB")."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        text = size.strip().upper()
        unit = next((u for u in _UNITS if text.endswith(u)), None)
        try:
            number = fractions.Fraction(text[:-len(unit)].strip() if unit else text)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"cannot read the size {size!r}: use bytes or a number and a unit, e.g. "
                             "'5GB', '500MB', '2GiB'") from None
        value = int(number * _UNITS.get(unit, 1))
    else:
        raise TypeError(f"a size is an int or a string like '5GB', got {type(size).__name__}")
    if value <= 0:
        raise ValueError(f"a size must be positive, got {size!r}")
    return value


def _entries(entries: Iterable) -> list:
    """(name, dtype, shape) triples (or WeightEntry) checked: unique names, writable dtypes, sizes."""
    out, seen = [], set()
    for item in entries:
        name, dtype, shape = (item.name, item.dtype, item.shape) if isinstance(item, WeightEntry) else item
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"a tensor name must be a string other than '__metadata__', got {name!r}")
        if name in seen:
            raise ValueError(f"tensor {name!r} is listed twice")
        safetensors_code(dtype)
        shape = tuple(shape)
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r} has shape {shape}, not a tuple of sizes")
        seen.add(name)
        out.append(WeightEntry(name, dtype, tuple(int(d) for d in shape)))
    return out


def plan_files(entries: Iterable, max_shard_size="5GB") -> list:
    """Tensor names per file, in `entries`' order, split greedily as huggingface_hub splits a state dict: a
    new file when the next tensor would take the open one over `max_shard_size`; a larger tensor gets a
    file of its own where it is met, the open file staying open. No entries: one empty file."""
    limit = parse_size(max_shard_size)
    files, current, size = [], [], 0
    for entry in _entries(entries):
        if entry.nbytes > limit:
            files.append([entry.name])
            continue
        if size + entry.nbytes > limit:
            files.append(current)
            current, size = [], 0
        current.append(entry.name)
        size += entry.nbytes
    if current or not files:
        files.append(current)
    return files


def file_names(count: int) -> list:
    """model.safetensors for one file; model-00001-of-0000N.safetensors ... for N > 1."""
    if count == 1:
        return [SAFE_WEIGHTS]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def layout_file(name: str, entries: list, metadata: dict) -> FileLayout:
    """The header and tensor positions of one file (Note [Safetensors written in pieces])."""
    header = {"__metadata__": metadata} if metadata else {}
    begins, end = {}, 0
    for entry in sorted(entries, key=lambda e: -e.dtype.itemsize):    # stable: the caller's order otherwise
        header[entry.name] = {"dtype": safetensors_code(entry.dtype), "shape": list(entry.shape),
                              "data_offsets": [end, end + entry.nbytes]}
        begins[entry.name] = end
        end += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return FileLayout(name, head, {n: len(head) + b for n, b in begins.items()}, len(head) + end)


def index_bytes(layouts: list, entries: list) -> bytes:
    """model.safetensors.index.json as transformers writes it (sorted keys, indent 2, a final newline)."""
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
             "weight_map": {n: layout.name for layout in layouts for n in layout.starts}}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def _checked_metadata(metadata: dict) -> dict:
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise TypeError(f"safetensors metadata maps strings to strings, got {metadata!r}")
    return dict(metadata)


def _checked_extra_files(extra_files: dict | None, taken: set) -> dict:
    out = {}
    for name, data in (extra_files or {}).items():
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(f"extra file {name!r} must be a plain file name (it is written beside the weights)")
        if name in taken:
            raise ValueError(f"extra file {name!r} would overwrite a weight file")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"extra file {name!r} must be bytes, got {type(data).__name__}")
        out[name] = bytes(data)
    return out


# --------------------------------------------------------- coverage
class _Coverage:
    """The element ranges of one tensor written so far: sorted, disjoint, touching ones merged."""

    def __init__(self):
        self._spans = []

    def overlap(self, lo: int, hi: int) -> tuple | None:
        """Some [a, b) inside [lo, hi) that was written already, or None."""
        i = bisect.bisect_right(self._spans, (lo, math.inf))    # spans[i - 1] is the last starting <= lo
        for a, b in self._spans[max(i - 1, 0):i + 1]:
            if a < hi and lo < b:
                return max(a, lo), min(b, hi)
        return None

    def add(self, lo: int, hi: int) -> None:
        i = bisect.bisect_left(self._spans, (lo, hi))
        if i > 0 and self._spans[i - 1][1] == lo:
            i -= 1
            lo = self._spans.pop(i)[0]
        if i < len(self._spans) and self._spans[i][0] == hi:
            hi = self._spans.pop(i)[1]
        self._spans.insert(i, (lo, hi))

    @property
    def spans(self) -> list:
        return list(self._spans)

    def holes(self, numel: int) -> list:
        """The ranges of [0, numel) not written."""
        out, at = [], 0
        for a, b in self._spans + [(numel, numel)]:
            if a > at:
                out.append((at, a))
            at = b
        return out


def _describe_holes(holes: dict) -> str:
    """"'w' lacks elements [0, 4), [8, 16) of 16; ..." for the first few incomplete tensors."""
    parts = []
    for (name, numel), spans in list(holes.items())[:5]:
        shown = ", ".join(f"[{a}, {b})" for a, b in spans[:4]) + (", ..." if len(spans) > 4 else "")
        parts.append(f"{name!r} lacks elements {shown} of {numel}")
    more = f"; and {len(holes) - 5} more tensors" if len(holes) > 5 else ""
    return "; ".join(parts) + more


# Note [Replacing a folder]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Files are written into `.<name>.partial-<pid>-<random>` beside dest (same filesystem: renames are atomic;
# hidden: nobody takes it for a model), so a failed write leaves dest as it was; a killed writer's is removed
# by the next writer into the same parent (Note [Folders a killed writer leaves] in files.py). POSIX cannot rename a
# folder onto a non-empty one, so commit over an existing dest takes three steps: 1. dest ->
# `.<name>.replaced-<pid>-<random>`, 2. the partial folder -> dest, 3. the old one removed, only after the
# parent is fsynced. A crash between 1 and 2 leaves both folders whole beside dest (rename the `.replaced-`
# one back); an error in 2 renames the old one back before it propagates.
PARTIAL = re.compile(r"^\..+\.partial-(?P<pid>\d+)-[0-9a-f]+$")


def _sibling(dest: str, kind: str) -> str:
    parent, name = os.path.split(dest)
    return os.path.join(parent, f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _remove(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


def _replace_folder(new: str, dest: str) -> None:
    """Puts folder `new` at `dest`, replacing what is there (Note [Replacing a folder])."""
    parent = os.path.dirname(dest)
    if not os.path.lexists(dest):
        os.rename(new, dest)
        fsync_dir(parent)
        return
    old = _sibling(dest, "replaced")
    os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    fsync_dir(parent)
    _remove(old)


# ------------------------------------------------------------- writer
class WeightWriter:
    """A safetensors folder written in pieces, put at `dest` by `commit()`.

    `entries`: (name, dtype, shape) in the order that decides the split into files (`plan_files`).
    `metadata` goes into every header ({"format": "pt"} by default, as transformers expects);
    `extra_files` {file name: bytes} are written beside the weights. As a context manager an exception
    aborts and a clean exit commits. One writer thread.
    `into`: the partial folder of another writer of the same entries (another process, the same files): this
    one writes pieces into its files, `finish()` makes them durable and returns what was written, for the
    owner's `add_written` before its commit; it never commits, and its abort removes nothing.
    """

    def __init__(self, dest, entries: Iterable, max_shard_size="5GB", metadata: dict | None = None,
                 extra_files: dict | None = None, *, into: str | None = None):
        self.dest = os.path.abspath(os.fspath(dest))
        if os.path.lexists(self.dest) and not os.path.isdir(self.dest):
            raise WeightFileError(f"{self.dest} exists and is not a folder; weights are written as a folder")
        entries = _entries(entries)
        self._entries = {e.name: e for e in entries}
        metadata = {"format": "pt"} if metadata is None else _checked_metadata(metadata)
        plan = plan_files(entries, max_shard_size)
        self._layouts = [layout_file(file, [self._entries[n] for n in names], metadata)
                         for file, names in zip(file_names(len(plan)), plan)]
        self._index = index_bytes(self._layouts, entries) if len(self._layouts) > 1 else None
        self._extra = _checked_extra_files(extra_files, {lay.name for lay in self._layouts} | {SAFE_INDEX})
        self._written = {name: _Coverage() for name in self._entries}
        self._fds, self._where = [], {}
        self.owner = into is None
        if self.owner:
            parent = os.path.dirname(self.dest)
            os.makedirs(parent, exist_ok=True)
            remove_dead_partials(parent, PARTIAL)
            self.partial = _sibling(self.dest, "partial")
            """The folder written into until commit."""
            os.mkdir(self.partial)
            mark_owner(self.partial)
        else:
            self.partial = into
        self._state = "open"
        try:
            for layout in self._layouts:
                self._open(layout)
        except BaseException:
            self.abort()
            raise

    def _open(self, layout: FileLayout) -> None:
        """One file (the owner's: made at its full size, its header written); its tensors' element 0 noted."""
        path = os.path.join(self.partial, layout.name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666) if self.owner else os.open(path, os.O_WRONLY)
        self._fds.append(fd)
        if self.owner:
            pwrite_all(fd, layout.header, 0)
            os.ftruncate(fd, layout.size)
        self._where.update({name: (fd, start) for name, start in layout.starts.items()})

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"the write of {self.dest} was {self._state}; start a new WeightWriter")

    def write(self, name: str, values: torch.Tensor, lo: int = 0) -> None:
        """Puts the flat elements of `values` (any shape, the entry's dtype) at elements lo.. of `name`."""
        self._check_open()
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"{name!r} is not among the tensors this writer was given")
        if not torch.is_tensor(values) or values.dtype != entry.dtype:
            got = dtype_name(values.dtype) if torch.is_tensor(values) else type(values).__name__
            raise TypeError(f"{name!r} is written as {dtype_name(entry.dtype)} but the values are {got}: "
                            "cast them first")
        flat = packed_flat(values)
        hi = lo + flat.numel()
        if lo < 0 or hi > entry.numel:
            raise ValueError(f"elements [{lo}, {hi}) are outside {name!r}, which has {entry.numel}")
        twice = self._written[name].overlap(lo, hi)
        if twice is not None:
            raise ValueError(f"elements [{twice[0]}, {twice[1]}) of {name!r} were written already")
        if hi > lo:
            fd, start = self._where[name]
            pwrite_all(fd, bytes_of(flat), start + lo * entry.dtype.itemsize)
            self._written[name].add(lo, hi)

    def written(self) -> dict:
        """{name: [(lo, hi), ...]}: the element ranges this writer wrote (what a peer hands the owner)."""
        return {n: c.spans for n, c in self._written.items() if c.spans}

    def add_written(self, written: dict) -> None:
        """Ranges a peer writer wrote into this writer's files (its `finish()`), counted for commit's check."""
        for name, spans in written.items():
            for lo, hi in spans:
                twice = self._written[name].overlap(lo, hi)
                if twice is not None:
                    raise ValueError(f"elements [{twice[0]}, {twice[1]}) of {name!r} were written twice")
                self._written[name].add(lo, hi)

    def finish(self) -> dict:
        """A peer's end: its writes made durable, its files closed; returns `written()` for the owner."""
        if self.owner:
            raise RuntimeError("finish() is a peer writer's end; the owner commits")
        self._check_open()
        try:
            self._close_files(sync=True)
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        return self.written()

    def _holes(self) -> dict:
        holes = {(n, e.numel): self._written[n].holes(e.numel) for n, e in self._entries.items()}
        return {key: spans for key, spans in holes.items() if spans}

    def commit(self) -> None:
        """Checks every element was written, makes the files durable and puts the folder at dest.

        A hole raises WeightFileError and leaves the writer open (write the rest, commit again);
        any later failure aborts. Note [Replacing a folder] for what a crash leaves.
        """
        self._check_open()
        if not self.owner:
            raise RuntimeError("a peer writer does not commit: hand its finish() to the owner's add_written")
        holes = self._holes()
        if holes:
            raise WeightFileError(f"cannot commit {self.dest}: {_describe_holes(holes)}")
        try:
            self._close_files(sync=True)
            if self._index is not None:
                atomic_write_bytes(os.path.join(self.partial, SAFE_INDEX), self._index)
            for name, data in self._extra.items():
                atomic_write_bytes(os.path.join(self.partial, name), data)
            os.unlink(os.path.join(self.partial, OWNER))
            fsync_dir(self.partial)
            _replace_folder(self.partial, self.dest)
        except BaseException:
            self.abort()
            raise
        self._state = "committed"

    def _close_files(self, sync: bool) -> None:
        fds, self._fds, error = self._fds, [], None
        for fd in fds:
            try:
                if sync:
                    os.fsync(fd)
            except OSError as e:
                error = error or e
            finally:
                os.close(fd)
        if error is not None:
            raise error

    def abort(self) -> None:
        """Removes the partial folder (the owner; a peer only closes its files); dest stays as it was. Nothing
        after a commit."""
        if self._state in ("committed", "finished"):
            return
        self._state = "aborted"
        try:
            self._close_files(sync=False)
        finally:
            if self.owner:
                shutil.rmtree(self.partial, ignore_errors=True)

    def __enter__(self) -> "WeightWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or self._state != "open":
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise
