"""Hugging Face weight files read by element range: `open_weights(source)` -> WeightSource.

A source is a model folder as transformers saves it (model.safetensors; or model.safetensors.index.json and
its shards; or the pytorch_model.bin equivalents; safetensors first when both are there, as transformers
prefers), one .safetensors file, or one `torch.save(state_dict)` file. Every header and index is checked
when the source opens, before any value is read; then `read(name, lo, hi)` returns the flat elements
[lo, hi) of one tensor, for safetensors by one pread of those bytes and no others (Note [Safetensors
written in pieces] in format.py). A torch file is memory-mapped and sliced (a legacy, non-zip one is
loaded whole: it cannot be mapped). No process group, no downloads, no checksums (the formats have none).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import zipfile

import torch

from shardopt.weights.format import FOLDER_FILES, MAX_HEADER, SAFETENSORS_DTYPES, WeightFileError, bytes_of


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
class _Index:
    """A *.index.json: its path and its weight_map (tensor name -> shard file name)."""

    path: str
    weight_map: dict


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
