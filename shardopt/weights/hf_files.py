"""Hugging Face weight files: any element range of a tensor read, safetensors folders written in pieces.

Reading, `open_weights(source)`: a model folder as transformers saves it (model.safetensors; or
model.safetensors.index.json and its shards; or pytorch_model.bin, or pytorch_model.bin.index.json and
its shards; safetensors first when both are there, as transformers prefers), one .safetensors file, or
one `torch.save(state_dict)` file. Every header and index is checked when the source opens, before any
value is read; then `read(name, lo, hi)` returns the flat elements [lo, hi) of one tensor and, for
safetensors, reads those bytes and no others (one pread; Note [Safetensors written in pieces]). A
torch file is memory-mapped and sliced (a legacy, non-zip one is loaded whole: it cannot be mapped).

Writing, `WeightWriter(dest, entries)`: the folder transformers writes for the same tensors (one
model.safetensors, or model-0000i-of-0000N.safetensors + model.safetensors.index.json, split as
huggingface_hub splits), laid out and given its headers up front, so that `write(name, values, lo)`
puts any piece of any tensor at its place, in any order, and nothing ever needs a whole model (or a
whole tensor) in memory. `commit()` refuses a hole, then puts the folder at `dest` by rename (Note
[Replacing a folder]); until then a previous `dest` is untouched.

Not here: process groups and models (the caller decides which rank reads or writes what), dtype
conversion on write (the caller casts), tied weights (the caller names what to write; transformers
writes a tied weight once), downloads from the Hub, checksums (the formats have none), torch files
as output. Safetensors are little-endian and so is every host torch runs on; this code assumes it.
"""
from __future__ import annotations

import bisect
import dataclasses
import fractions
import json
import math
import os
import secrets
import shutil
import struct
import zipfile
from typing import Iterable

import torch

from shardopt.checkpoint.files import atomic_write_bytes, dtype_name, fsync_dir

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
FOLDER_FILES = (SAFE_WEIGHTS, SAFE_INDEX, TORCH_WEIGHTS, TORCH_INDEX)
"""What a model folder may hold, in the order transformers looks for them."""
MAX_HEADER = 100_000_000
"""The longest safetensors header accepted (the safetensors crate's own limit)."""


class WeightFileError(ValueError):
    """A weight file, folder or write that is not what it claims: damaged, incomplete or inconsistent."""


# Note [Safetensors written in pieces]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A .safetensors file is three parts and nothing else:
#
#   bytes [0, 8)        N, the header's length: an unsigned 64-bit little-endian integer
#   bytes [8, 8 + N)    the header, UTF-8 JSON: {"__metadata__": {str: str},
#                       name: {"dtype": "BF16", "shape": [2, 3], "data_offsets": [begin, end]}, ...},
#                       padded with spaces so that 8 + N is a multiple of 8
#   bytes [8 + N, end)  the data: tensor `name` at [8 + N + begin, 8 + N + end), its elements row-major
#                       and little-endian, so end - begin = numel * itemsize; the tensors' ranges tile
#                       the data with no hole and no overlap (readers check), from 0 to the last end
#
# Everything in the header is known before any value is: dtypes and shapes fix each tensor's byte
# count, and the order we lay tensors out in fixes each begin. So the writer writes the header first,
# sets the file's size, and from then on element i of tensor t lives at byte
#
#   start(t) + i * itemsize(t),   start(t) = 8 + N + begin(t)
#
# A piece holding elements [lo, hi) of t is one pwrite of (hi - lo) * itemsize bytes at
# start(t) + lo * itemsize. Pieces of different tensors, or disjoint pieces of one, touch disjoint
# bytes, and pwrite moves no shared file position, so pieces can come in any order (bucket by bucket
# as a save gathers them) and the writer holds nothing but headers. What pieces cannot tell is whether
# every byte was written: an unwritten range reads back as zeros in a file that looks valid. Hence the
# writer counts every element (_Coverage), refuses a second write of one, and commit refuses a hole.
#
# Order inside a file: by itemsize, largest first, otherwise the caller's order. 8 + N is a multiple
# of 8 and itemsizes are powers of 2, so every tensor before t has a byte count that is a multiple of
# itemsize(t), and every tensor starts aligned to its itemsize: a reader may map it in place.
#
# Reading is the same arithmetic: elements [lo, hi) of t are bytes [start(t) + lo * s, start(t) + hi * s)
# with s = itemsize(t), one pread into the new tensor's own memory.


# ------------------------------------------------------------------ dtypes
def _dtype_table() -> dict:
    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
             "U8": torch.uint8, "BOOL": torch.bool}
    optional = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                "U16": "uint16", "U32": "uint32", "U64": "uint64"}
    table.update({code: getattr(torch, attr) for code, attr in optional.items() if hasattr(torch, attr)})
    return table


SAFETENSORS_DTYPES = _dtype_table()
"""Safetensors dtype code -> torch dtype, for every code this module reads and writes."""
_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_code(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16" for torch.bfloat16)."""
    if dtype not in _CODES:
        raise TypeError(f"safetensors has no dtype for {dtype_name(dtype)}; these can be written: "
                        f"{', '.join(dtype_name(d) for d in _CODES)}")
    return _CODES[dtype]


# ------------------------------------------------------------------ records
@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """Where one tensor of a source lies: its file, dtype, shape and (safetensors) first byte."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple
    offset: int | None
    """Byte of element 0 in a safetensors file; None in a torch file."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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


@dataclasses.dataclass(frozen=True)
class _Index:
    """A *.index.json: its path and its weight_map (tensor name -> shard file name)."""

    path: str
    weight_map: dict


# ----------------------------------------------------------- low-level I/O
def _pread_into(fd: int, buf, offset: int, path: str) -> None:
    """Fills the writable buffer `buf` from byte `offset` of the file (pread may return short)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise WeightFileError(f"{path}: the file ends at byte {offset + done}, inside a tensor it held "
                                  "when it was opened (truncated since?)")
        done += got


def pwrite_all(fd: int, buf, offset: int) -> None:
    """Writes all of `buf` at byte `offset` (pwrite may write less than asked)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def bytes_of(t: torch.Tensor):
    """The bytes of a 1-D tensor of stride 1 as a writable numpy array (no copy; any dtype, bf16 too)."""
    return t.view(torch.uint8).numpy()


def packed_flat(values: torch.Tensor) -> torch.Tensor:
    """The elements of `values`, row-major, as a 1-D CPU tensor of stride 1 (copied only if need be).

    Not `.contiguous()`: torch calls a one-element view of stride 2 contiguous, and it is not packed.
    """
    flat = values.detach().to("cpu").reshape(-1)
    return flat if flat.stride(0) == 1 else torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    """json's object_pairs_hook: a key twice in one object is an error, not the last one winning."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _parse_json(path: str, raw: bytes, what: str):
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise WeightFileError(f"{path}: {e.args[0]!r} appears twice in the {what}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise WeightFileError(f"{path}: the {what} is not valid JSON ({e})") from None


# ------------------------------------------------------ safetensors, read
def _header_length(path: str, fd: int, size: int) -> int:
    if size < 8:
        raise WeightFileError(f"{path}: truncated: {size} bytes, header needs 8 (the header's length)")
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > MAX_HEADER:
        raise WeightFileError(f"{path}: header length {n} (the file's first 8 bytes) is over the "
                              f"{MAX_HEADER} bytes safetensors allows: not a safetensors file?")
    if 8 + n > size:
        raise WeightFileError(f"{path}: truncated: {size} bytes, header needs {8 + n} (its length alone)")
    return n


def _metadata_of(path: str, header: dict) -> dict:
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise WeightFileError(f"{path}: __metadata__ must map strings to strings, got {meta!r}")
    return meta


def _shape_of(path: str, name: str, shape) -> tuple:
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise WeightFileError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of sizes")
    return tuple(shape)


def _record_of(path: str, name: str, entry, data_start: int) -> TensorRecord:
    """One header entry checked: known dtype, a shape, and data_offsets holding exactly its bytes."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise WeightFileError(f"{path}: tensor {name!r} needs dtype, shape and data_offsets, got {entry!r}")
    code = entry["dtype"]
    if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
        raise WeightFileError(f"{path}: tensor {name!r} has dtype {code!r}, which this reader does not know "
                              f"(it reads {', '.join(SAFETENSORS_DTYPES)})")
    dtype, shape, offsets = SAFETENSORS_DTYPES[code], _shape_of(path, name, entry["shape"]), entry["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise WeightFileError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    need = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != need:
        raise WeightFileError(f"{path}: tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]} "
                              f"bytes but shape {list(shape)} of {code} needs {need}")
    return TensorRecord(name, path, dtype, shape, data_start + offsets[0])


def _nbytes(r: TensorRecord) -> int:
    return r.numel * r.dtype.itemsize


def _check_tiling(path: str, records: list, data_start: int) -> int:
    """Records (sorted by offset) cover the data with no hole or overlap; returns where the data ends."""
    end = data_start
    for r in records:
        if r.offset != end:
            raise WeightFileError(f"{path}: tensor {r.name!r} starts at data byte {r.offset - data_start} but "
                                  f"the tensors before it end at {end - data_start} (safetensors data has no "
                                  "holes or overlaps)")
        end += _nbytes(r)
    return end


def _check_size(path: str, records: list, data_end: int, size: int) -> None:
    """The file holds every byte the header promises."""
    if data_end <= size:
        return
    first = next(r for r in records if r.offset + _nbytes(r) > size)
    raise WeightFileError(f"{path}: truncated: {size} bytes, header needs {data_end} (tensor {first.name!r}, "
                          f"bytes {first.offset}..{first.offset + _nbytes(first)}, is the first past the end)")


def _read_header(path: str, fd: int) -> tuple:
    """(metadata, records in file order) of an open safetensors file, every entry checked."""
    size = os.fstat(fd).st_size
    n = _header_length(path, fd, size)
    header = _parse_json(path, os.pread(fd, n, 8), "header")
    if not isinstance(header, dict):
        raise WeightFileError(f"{path}: the header is JSON but not an object")
    records = sorted((_record_of(path, name, entry, 8 + n) for name, entry in header.items()
                      if name != "__metadata__"), key=lambda r: (r.offset, _nbytes(r)))
    _check_size(path, records, _check_tiling(path, records, 8 + n), size)
    return _metadata_of(path, header), records


class _SafetensorsFile:
    """One open .safetensors file: its checked header and a descriptor kept open for preads."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.metadata, self.records = _read_header(path, self._fd)
        except BaseException:
            os.close(self._fd)
            raise

    def read(self, record: TensorRecord, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=record.dtype)
        if hi > lo:
            _pread_into(self._fd, bytes_of(out), record.offset + lo * record.dtype.itemsize, self.path)
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ---------------------------------------------------------- torch, read
def _load_torch(path: str) -> dict:
    """A torch.save'd state dict, memory-mapped when the file allows (the zip format does)."""
    try:
        obj = torch.load(path, mmap=zipfile.is_zipfile(path), weights_only=True, map_location="cpu")
    except Exception as e:
        raise WeightFileError(f"{path}: neither a safetensors file nor a state dict that "
                              f"torch.load(weights_only=True) reads ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise WeightFileError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    for key, value in obj.items():
        if not isinstance(key, str) or not torch.is_tensor(value):
            raise WeightFileError(f"{path}: entry {key!r} is a {type(value).__name__}; a state dict maps "
                                  "names to tensors (a checkpoint holding one is not a weights file)")
    return obj


class _TorchFile:
    """One torch state-dict file, mapped (or loaded, for the legacy format), sliced on read."""

    def __init__(self, path: str):
        self.path = path
        self.metadata = {}
        self._tensors = _load_torch(path)
        self.records = [TensorRecord(name, path, t.dtype, tuple(t.shape), None)
                        for name, t in self._tensors.items()]

    def read(self, record: TensorRecord, lo: int, hi: int) -> torch.Tensor:
        # reshape is a view of a contiguous tensor (only [lo, hi) is touched, so paged in); a
        # non-contiguous one (rare in weight files) is copied whole first.
        return self._tensors[record.name].reshape(-1)[lo:hi].clone()

    def close(self) -> None:
        self._tensors = {}


def _looks_like_safetensors(path: str) -> bool:
    """By name, or by content: an 8-byte length that fits the file, then '{'."""
    if path.endswith(".safetensors"):
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:] == b"{" and struct.unpack("<Q", head[:8])[0] < os.path.getsize(path)


def _open_file(path: str):
    return _SafetensorsFile(path) if _looks_like_safetensors(path) else _TorchFile(path)


# -------------------------------------------------------- folders, index
def _read_index(path: str) -> _Index:
    with open(path, "rb") as f:
        doc = _parse_json(path, f.read(), "index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightFileError(f"{path}: no weight_map of tensor name -> file name")
    return _Index(path, weight_map)


def _shard_paths(index: _Index) -> list:
    """The shard files an index names, in name order (00001 first), each checked to exist."""
    folder, paths = os.path.dirname(index.path), []
    for file in sorted(set(index.weight_map.values())):
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            first = next(name for name, f in index.weight_map.items() if f == file)
            raise WeightFileError(f"{path} listed in {os.path.basename(index.path)} for {first!r} is missing")
        paths.append(path)
    return paths


def _weight_files(source: str) -> tuple:
    """(files to open, the index naming them or None) for a folder or a single file."""
    if os.path.isdir(source):
        for name in FOLDER_FILES:
            path = os.path.join(source, name)
            if os.path.isfile(path):
                return _weight_files(path)
        raise WeightFileError(f"{source} holds no Hugging Face weights: looked for {', '.join(FOLDER_FILES)}")
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source} does not exist: pass a model folder, a .safetensors file or a "
                                "torch state-dict file")
    if source.endswith(".index.json"):
        index = _read_index(source)
        return _shard_paths(index), index
    return [source], None


def _check_index(index: _Index, source: "WeightSource") -> None:
    """Every name the index lists is in the file it says (the files may hold more, as transformers allows)."""
    for name, file in index.weight_map.items():
        if name not in source:
            raise WeightFileError(f"{index.path} lists {name!r} in {file}, which holds no such tensor")
        actual = os.path.basename(source.file_of(name))
        if actual != file:
            raise WeightFileError(f"{index.path} lists {name!r} in {file} but it is in {actual}")


class WeightSource:
    """The tensors of a model's weight files, by name: shapes and dtypes, and elements read by range.

    Made by `open_weights`; holds each file open (a descriptor, or a mapping) until `close()`.
    `metadata` is the safetensors __metadata__ of the first file ({} for torch files).
    """

    def __init__(self, source: str, files: list):
        self.source = source
        self._files = files
        self._where = {}
        for file in files:
            for record in file.records:
                if record.name in self._where:
                    raise WeightFileError(f"tensor {record.name!r} is in two files: "
                                          f"{self._where[record.name][1].path} and {record.path}")
                self._where[record.name] = (file, record)
        self.metadata = dict(files[0].metadata) if files else {}

    def _record(self, name: str) -> tuple:
        if self._files is None:
            raise ValueError(f"the weights of {self.source} were closed")
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.source}")
        return self._where[name]

    def names(self) -> list:
        """Every tensor's name, in file order (files in name order, then by position in the file)."""
        return list(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple:
        return self._record(name)[1].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._record(name)[1].dtype

    def file_of(self, name: str) -> str:
        return self._record(name)[1].path

    def read(self, name: str, lo: int = 0, hi: int | None = None, dtype: torch.dtype | None = None):
        """The flat elements [lo, hi) of tensor `name` as a new 1-D tensor, cast to `dtype` if given."""
        file, record = self._record(name)
        hi = record.numel if hi is None else hi
        if not 0 <= lo <= hi <= record.numel:
            raise ValueError(f"elements [{lo}, {hi}) are outside {name!r}, which has {record.numel}")
        out = file.read(record, lo, hi)
        return out if dtype is None or dtype == out.dtype else out.to(dtype)

    def close(self) -> None:
        for file in self._files or ():
            file.close()
        self._files = None

    def __enter__(self) -> "WeightSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_weights(source) -> WeightSource:
    """The weights at `source` (a model folder or one file; module docstring), every file checked."""
    source = os.fspath(source)
    paths, index = _weight_files(source)
    files = []
    try:
        for path in paths:
            files.append(_open_file(path))
        weights = WeightSource(source, files)
        if index is not None:
            _check_index(index, weights)
        return weights
    except BaseException:
        for file in files:
            file.close()
        raise


# ------------------------------------------------------ planning a write
_UNITS = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
          "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(size) -> int:
    """Bytes in `size`: an int, or a number and a unit, "5GB" = 5 * 10**9, "5GiB" = 5 * 2**30.

    Decimal units TB GB MB KB (huggingface_hub's, which transformers' save_pretrained uses) and binary
    TiB GiB MiB KiB, any case, fractions allowed ("1.5GB").
    """
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
    """Tensor names per file, in `entries`' order, split as huggingface_hub splits a state dict.

    Greedy: a tensor goes into the open file unless that would take it over `max_shard_size`, when a new
    file opens. A tensor larger than the limit gets a file of its own, placed when it is met, and the
    open file stays open (huggingface_hub does the same, and file names follow this order). No entries:
    one empty file.
    """
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
# The files are written into a sibling of dest, `.<name>.partial-<pid>-<random>`: the same parent, so
# the same filesystem and renames are atomic; hidden, so nobody takes it for a model. dest is not
# touched before commit, so a failed or aborted write leaves a previous dest as it was. At commit, with
# no dest yet, one rename is the commit. With one, POSIX cannot swap two folders in one rename (a
# rename onto a non-empty folder fails), so commit takes three steps:
#
#   1. dest -> `.<name>.replaced-<pid>-<random>`   2. the partial folder -> dest   3. the old one removed
#
# A crash between 1 and 2 leaves no dest but both folders whole beside it (rename the `.replaced-` one
# back to restore); the old one is deleted only once the new one is at dest and the parent is fsynced.
# If step 2 fails with an error rather than a crash, the old folder is renamed back before it propagates.
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
    """A safetensors folder written in pieces, put at `dest` by `commit()` (module docstring).

    `entries`: (name, dtype, shape) in the order to write, which decides the split into files
    (`plan_files`). `metadata` goes into every file's header ({"format": "pt"} by default: transformers
    expects it); `extra_files` {file name: bytes} are written beside the weights (config.json). As a
    context manager: an exception aborts; a clean exit commits unless commit() or abort() came first.
    Not thread-safe (one writer thread; pwrite itself would allow more).
    """

    def __init__(self, dest, entries: Iterable, max_shard_size="5GB", metadata: dict | None = None,
                 extra_files: dict | None = None):
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
        os.makedirs(os.path.dirname(self.dest), exist_ok=True)
        self.partial = _sibling(self.dest, "partial")
        """The folder written into until commit."""
        os.mkdir(self.partial)
        self._state = "open"
        try:
            for layout in self._layouts:
                self._create(layout)
        except BaseException:
            self.abort()
            raise

    def _create(self, layout: FileLayout) -> None:
        """One file at its full size, its header written; its tensors' element 0 noted."""
        fd = os.open(os.path.join(self.partial, layout.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._fds.append(fd)
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

    def _holes(self) -> dict:
        holes = {(n, e.numel): self._written[n].holes(e.numel) for n, e in self._entries.items()}
        return {key: spans for key, spans in holes.items() if spans}

    def commit(self) -> None:
        """Checks every element was written, makes the files durable and puts the folder at dest.

        A hole raises WeightFileError and leaves the writer open (write the rest, commit again);
        any later failure aborts. Note [Replacing a folder] for what a crash leaves.
        """
        self._check_open()
        holes = self._holes()
        if holes:
            raise WeightFileError(f"cannot commit {self.dest}: {_describe_holes(holes)}")
        try:
            self._close_files(sync=True)
            if self._index is not None:
                atomic_write_bytes(os.path.join(self.partial, SAFE_INDEX), self._index)
            for name, data in self._extra.items():
                atomic_write_bytes(os.path.join(self.partial, name), data)
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
        """Removes the partial folder; dest stays as it was. Nothing after a commit."""
        if self._state == "committed":
            return
        self._state = "aborted"
        try:
            self._close_files(sync=False)
        finally:
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
