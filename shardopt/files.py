"""Checkpoint files: tensor records with checksums, atomic writes, the manifest's exact JSON encoding.

Pure file code: no process group, no optimizer. The directory layout and the
crash-safety argument are in Note [Checkpoint layout] (checkpoint/save_load.py).

A *record file* is the raw bytes of tensors one after another (native byte
order, no header); where each tensor is, its dtype, shape and crc32 are kept
in the manifest as a *ref*. A reader can then fetch any single tensor with one
seek and verify it alone, which is what lets a rank load only the ranges it
owns.
"""
from __future__ import annotations

import json
import os
import zlib

import torch

FORMAT = "shardopt-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded: damaged, incomplete, or of a different model."""


# ------------------------------------------------------------- atomic files
def fsync_dir(path: str) -> None:
    """Makes a rename or a new file in `path` durable (POSIX: the directory entry is data too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Writes `path` so that a crash leaves either the old file or the whole new one, never a mix."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


# Note [Folders a killed writer leaves]
# A save writes into a hidden partial folder beside its destination and renames it into place; a writer
# killed before the rename leaves the folder. Each is marked with its maker (host, pid namespace, pid: one
# line in OWNER, removed before the rename), and the next save into the same parent directory removes the
# partial folders whose maker is gone: on this host and in this pid namespace (the only places a pid means
# something), and not alive, or this process itself (its saves run one at a time: an earlier one failed). A
# live writer's folder, or one made elsewhere, is never touched.
OWNER = ".shardopt-owner"


def _me() -> list[str]:
    import socket

    from shardopt.parallel.shm_barrier import pid_namespace
    return [socket.gethostname(), str(pid_namespace()), str(os.getpid())]


def mark_owner(folder: str) -> None:
    """Names this process as the maker of partial folder `folder` (Note [Folders a killed writer leaves])."""
    with open(os.path.join(folder, OWNER), "w") as f:
        f.write(" ".join(_me()) + "\n")


def maker_gone(folder: str, pid: int | None = None) -> bool:
    """Whether the maker of partial folder `folder` is known to be gone (its OWNER line, else `pid`)."""
    from shardopt.parallel.shm_barrier import pid_alive

    host, namespace, _ = _me()
    try:
        with open(os.path.join(folder, OWNER)) as f:
            their_host, their_namespace, their_pid = f.read().split()
    except (OSError, ValueError):
        return pid is not None and (pid == os.getpid() or not pid_alive(pid))
    if (their_host, their_namespace) != (host, namespace):
        return False
    return int(their_pid) == os.getpid() or not pid_alive(int(their_pid))


def remove_dead_partials(parent: str, pattern) -> list[str]:
    """Removes the folders in `parent` whose name matches `pattern` (a compiled regex; its group "pid", if
    any, the maker's pid) and whose maker is gone; returns their names."""
    import shutil

    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        path = os.path.join(parent, name)
        if m is None or not os.path.isdir(path) or os.path.islink(path):
            continue
        pid = int(m.group("pid")) if "pid" in pattern.groupindex else None
        if maker_gone(path, pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


# ------------------------------------------------------------ tensor records
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint")
    return dt


class RecordWriter:
    """Appends tensors to one record file; `add` returns each one's ref (see module docstring)."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "wb")
        self._crc = 0
        self.size = 0

    def add(self, t: torch.Tensor) -> dict:
        t = t.detach().to("cpu").contiguous()
        # Through uint8 so every dtype (bf16 included) has a numpy view: no copy.
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        crc = zlib.crc32(data)
        self._f.write(data)
        ref = {"offset": self.size, "nbytes": len(data) if t.numel() else 0, "dtype": dtype_name(t.dtype),
               "shape": list(t.shape), "crc32": crc}
        self._crc = zlib.crc32(data, self._crc)
        self.size += ref["nbytes"]
        return ref

    def close(self) -> dict:
        """Flushes the file to disk; returns its entry for the manifest (size, whole-file crc32)."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"size": self.size, "crc32": self._crc}

    def abort(self) -> None:
        self._f.close()


class RecordReader:
    """Reads tensors by ref from the record files of one checkpoint directory, verifying each."""

    def __init__(self, directory: str, files: dict):
        self.directory = directory
        self.files = files      # manifest "files": name -> {"size", "crc32", ...}
        self._open: dict = {}

    def _handle(self, name: str):
        f = self._open.get(name)
        if f is None:
            path = os.path.join(self.directory, name)
            if name not in self.files:
                raise CheckpointError(f"the manifest lists no file {name!r}")
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or was partly "
                                      "deleted; load an earlier one") from None
            size = os.fstat(f.fileno()).st_size
            want = self.files[name]["size"]
            if size != want:
                f.close()
                raise CheckpointError(f"{path} is {size} bytes but the manifest says {want}: the file was "
                                      "truncated or overwritten; load an earlier checkpoint")
            self._open[name] = f
        return f

    def read(self, name: str, ref: dict) -> torch.Tensor:
        dtype, shape = parse_dtype(ref["dtype"]), tuple(ref["shape"])
        if ref["nbytes"] == 0:
            return torch.empty(shape, dtype=dtype)
        f = self._handle(name)
        f.seek(ref["offset"])
        buf = bytearray(ref["nbytes"])
        got = f.readinto(buf)
        where = f"{os.path.join(self.directory, name)} bytes {ref['offset']}..{ref['offset'] + ref['nbytes']}"
        if got != len(buf):
            raise CheckpointError(f"{where}: file ends early; load an earlier checkpoint")
        if zlib.crc32(buf) != ref["crc32"]:
            raise CheckpointError(f"{where}: checksum mismatch, the file is corrupted; load an earlier "
                                  "checkpoint")
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)

    def verify_file(self, name: str) -> None:
        """Checks one whole file against its manifest size and crc32."""
        f = self._handle(name)
        f.seek(0)
        crc = 0
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
        if crc != self.files[name]["crc32"]:
            raise CheckpointError(f"{os.path.join(self.directory, name)}: checksum mismatch, the file is "
                                  "corrupted; load an earlier checkpoint")

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


# --------------------------------------------------------- manifest encoding
# JSON has no tuples, tensors or dtypes, and param groups hold them (betas is a
# tuple; a scheduler may put a tensor lr). A tagged encoding keeps the manifest
# readable and the round trip exact, so loaded hyper-parameters equal saved ones.
def to_json(obj, where: str = "value"):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json(v, where) for v in obj]}
    if isinstance(obj, list):
        return [to_json(v, where) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: to_json(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [[to_json(k, where), to_json(v, where)] for k, v in obj.items()]}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": dtype_name(obj)}
    if torch.is_tensor(obj) and obj.numel() <= 64:
        return {"__tensor__": obj.detach().cpu().tolist(), "dtype": dtype_name(obj.dtype),
                "shape": list(obj.shape)}
    raise CheckpointError(f"cannot store {where} of type {type(obj).__name__} in the checkpoint manifest; "
                          "keep param groups and loss-scaler state to numbers, strings, tuples and small "
                          "tensors (put anything else in `extra`)")


def from_json(obj):
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tuple__" in obj:
        return tuple(from_json(v) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {from_json(k): from_json(v) for k, v in obj["__items__"]}
    if "__dtype__" in obj:
        return parse_dtype(obj["__dtype__"])
    if "__tensor__" in obj:
        return torch.tensor(obj["__tensor__"], dtype=parse_dtype(obj["dtype"])).reshape(obj["shape"])
    return {k: from_json(v) for k, v in obj.items()}


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def manifest_bytes(body: dict) -> bytes:
    import hashlib

    digest = hashlib.sha256(_canonical(body)).hexdigest()
    # Compact: every loading rank reads it (pretty-print with `python -m json.tool`).
    return json.dumps({"format": FORMAT, "version": VERSION, "sha256": digest, "body": body},
                      separators=(",", ":")).encode()


def read_manifest(directory: str) -> dict:
    """The verified manifest body of the checkpoint in `directory`."""
    import hashlib

    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: {directory} is not a complete shardopt checkpoint "
                              "(a save that crashed never gets a manifest); load an earlier one") from None
    try:
        doc = json.loads(raw)
        body = doc["body"]
        fmt, version, digest = doc["format"], doc["version"], doc["sha256"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} is not a valid manifest (truncated or corrupted); load an earlier "
                              "checkpoint") from None
    if fmt != FORMAT:
        raise CheckpointError(f"{path} is a {fmt!r} file, not a {FORMAT}")
    if version != VERSION:
        raise CheckpointError(f"{path} has format version {version}; this shardopt reads version {VERSION}: "
                              "load it with the shardopt version that wrote it and convert it "
                              "(`python -m shardopt convert`)")
    if hashlib.sha256(_canonical(body)).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch, the manifest is corrupted; load an earlier checkpoint")
    return body
