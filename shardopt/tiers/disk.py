"""A rank's scratch file on disk, read and written with direct I/O, several requests in flight.

    buf = aligned_empty(numel, torch.float32)            # page-aligned host memory (direct I/O needs it)
    f = ScratchFile(nvme_path, "optimizer", nbytes, aio)  # reserved on disk now; gone when the process is
    f.start_write(offset, buf).wait()                     # offsets and lengths: multiples of ALIGN bytes
    f.start_read(offset, buf).wait()

Note [Direct I/O for the tiers]
-------------------------------
A tier exists because the training state does not fit the rank's memory, so the page cache must not hold it
a second time: with buffered I/O every byte read or written would sit in the cache too, and a memory-capped
job (a cgroup charges page cache) would be charged for it. So the scratch files are opened with O_DIRECT:
transfers go between the disk and the caller's buffer, which must be page-aligned (`aligned_empty`), at
offsets and lengths that are multiples of ALIGN. A transfer is cut into blocks of `block_size` bytes,
handed to a pool of thread_count x queue_depth threads that each run pread/pwrite (the GIL is released in
the system call): as many blocks in flight as DeepSpeed's aio keeps with the same settings, which a disk
needs to reach its sequential rate. Starting a transfer never waits for the disk.
The file is made without a name (O_TMPFILE; else created and unlinked at once), so no run leaves a scratch
file behind however it ends, and none is trusted by the next run; its space is reserved when it is made
(posix_fallocate), so a disk too small for the tier is refused at construction, naming the path and the
bytes, instead of filling up in the middle of a step.
"""
from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from shardopt.parallel.comm import all_reduce
from shardopt.parallel.consistency import first_failure

ALIGN = 4096  # bytes: offsets, lengths and buffer addresses of direct I/O


class TierError(RuntimeError):
    """A tier's file could not be made, read or written: the message names the path and the fix."""


@dataclasses.dataclass(frozen=True)
class AioConfig:
    """How a scratch file is read and written (DeepSpeed's `aio` block, the same names)."""

    block_size: int = 1 << 20
    """Bytes per request handed to a thread (a multiple of 4096)."""
    queue_depth: int = 8
    """Requests in flight per issuing thread."""
    thread_count: int = 1
    """Issuing threads: thread_count x queue_depth requests in flight at most."""

    def __post_init__(self):
        for name in ("block_size", "queue_depth", "thread_count"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"aio.{name} must be a whole number >= 1, got {v!r}")
        if self.block_size % ALIGN:
            raise ValueError(f"aio.block_size must be a multiple of {ALIGN} bytes (direct I/O), got "
                             f"{self.block_size}")


def round_up(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` elements of uninitialised host memory starting on a page, its byte length rounded up to ALIGN
    (anonymous memory: the kernel gives it back when the tensor goes)."""
    nbytes = round_up(max(numel * dtype.itemsize, 1))
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype)[:numel]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, writable, for pread/pwrite (a contiguous host tensor)."""
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


class Request:
    """Requests in flight for one transfer; wait() returns once all are done, or raises TierError."""

    __slots__ = ("futures", "what")

    def __init__(self, futures: list[Future], what: str):
        self.futures, self.what = futures, what

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        errors = [f.exception() for f in self.futures]
        self.futures = []
        for e in errors:
            if e is not None:
                raise e


class ScratchFile:
    """`nbytes` of scratch space in `directory`, this process's alone, read and written with direct I/O (Note
    [Direct I/O for the tiers])."""

    def __init__(self, directory: str, kind: str, nbytes: int, aio: AioConfig = AioConfig()):
        self.directory, self.kind, self.aio = directory, kind, aio
        self.nbytes = round_up(nbytes)
        self.fd = open_unnamed(directory, kind)
        try:
            reserve(self.fd, self.nbytes, directory, kind)
        except BaseException:
            os.close(self.fd)
            raise
        self.pool = ThreadPoolExecutor(aio.thread_count * aio.queue_depth, thread_name_prefix=f"shardopt-{kind}-io")
        self.bytes_read = self.bytes_written = 0

    def start_read(self, offset: int, into: torch.Tensor) -> Request:
        """Starts reading len(into) bytes (rounded up to ALIGN) at byte `offset` into `into`."""
        return self._start(offset, into, write=False)

    def start_write(self, offset: int, src: torch.Tensor) -> Request:
        """Starts writing `src` (its bytes rounded up to ALIGN: the buffer's padding) at byte `offset`."""
        return self._start(offset, src, write=True)

    def _start(self, offset: int, t: torch.Tensor, write: bool) -> Request:
        if self.fd < 0:
            raise TierError(f"the {self.kind} scratch file in {self.directory} is closed")
        mv = _padded_bytes(t)
        n = len(mv)
        if offset % ALIGN or offset + n > self.nbytes or t.data_ptr() % ALIGN:
            raise ValueError(f"direct I/O of {n} bytes at offset {offset} of a {self.nbytes}-byte file from address "
                             f"{t.data_ptr():#x}: offsets and addresses must be multiples of {ALIGN} inside the file")
        futures = []
        for at in range(0, n, self.aio.block_size):
            piece = mv[at:at + self.aio.block_size]
            futures.append(self.pool.submit(self._transfer, offset + at, piece, write))
        if write:
            self.bytes_written += n
        else:
            self.bytes_read += n
        return Request(futures, "write" if write else "read")

    def _transfer(self, offset: int, piece: memoryview, write: bool) -> None:
        try:
            done = 0
            while done < len(piece):
                part = piece[done:]
                n = os.pwrite(self.fd, part, offset + done) if write else os.preadv(self.fd, [part], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short transfer")
                done += n
        except OSError as e:
            raise TierError(f"shardopt: {'writing' if write else 'reading'} {len(piece)} bytes at offset {offset} of "
                            f"the {self.kind} scratch file in {self.directory} failed: {e.strerror or e} "
                            f"(errno {e.errno}); check the disk behind nvme_path") from e

    def close(self) -> None:
        if self.fd >= 0:
            self.pool.shutdown(wait=True)
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass


def _padded_bytes(t: torch.Tensor) -> memoryview:
    """t's bytes, rounded up to ALIGN through the buffer's own padding (aligned_empty's)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("direct I/O needs a contiguous host tensor (an aligned_empty buffer or a view of one)")
    n = round_up(t.numel() * t.element_size())
    storage = t.untyped_storage()
    start = t.storage_offset() * t.element_size()
    if start + n > storage.nbytes():
        raise ValueError(f"the buffer has no room for {n} bytes from its start (direct I/O moves whole "
                         f"{ALIGN}-byte blocks): allocate it with aligned_empty")
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    return _bytes_of(whole[start:start + n])


def filesystem_of(path: str) -> str:
    """The type of the filesystem `path` lies on (/proc/self/mounts: the longest mount point above it)."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def open_unnamed(directory: str, kind: str, direct: bool = True) -> int:
    """A new file in `directory` with no name, open for direct I/O (or, direct=False, for mapping)."""
    if not os.path.isdir(directory):
        raise TierError(f"nvme_path {directory!r} does not exist or is not a directory: create it (on a local "
                        f"disk) or point nvme_path at one")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise TierError(f"nvme_path {directory!r} is not writable by this process: fix its permissions or point "
                        f"nvme_path at a writable directory")
    fs = filesystem_of(directory)
    if fs in ("tmpfs", "ramfs"):
        raise TierError(f"nvme_path {directory!r} is on {fs}, which is memory: a tier there would hold the state "
                        f"in memory as files; point nvme_path at a directory on a disk (ext4, xfs), or use "
                        f"offload='cpu' for host memory")
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    try:
        return os.open(directory, flags | os.O_TMPFILE, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise TierError(f"nvme_path {directory!r}: cannot make the {kind} scratch file: {e.strerror}") from e
    name = os.path.join(directory, f".shardopt-{kind}-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise TierError(f"nvme_path {directory!r} is on a filesystem without direct I/O (O_DIRECT), e.g. tmpfs: "
                            f"a tier there would hold the state in memory twice; point nvme_path at a directory "
                            f"on a disk (ext4, xfs)") from e
        raise TierError(f"nvme_path {directory!r}: cannot make the {kind} scratch file: {e.strerror}") from e
    os.unlink(name)
    return fd


def reserve(fd: int, nbytes: int, directory: str, kind: str) -> None:
    """`nbytes` of disk taken for the file now, or a TierError naming the path and the fix."""
    free = os.statvfs(directory)
    free = free.f_bavail * free.f_frsize
    if nbytes > free:
        raise TierError(f"nvme_path {directory!r} has {free / 2**30:.2f} GiB free; the {kind} tier of this rank "
                        f"needs {nbytes / 2**30:.2f} GiB: free space there or point nvme_path at a larger disk")
    try:
        os.posix_fallocate(fd, 0, max(nbytes, ALIGN))
    except OSError as e:
        os.ftruncate(fd, 0)  # whatever was taken before the disk filled up
        if e.errno == errno.ENOSPC:
            raise TierError(f"nvme_path {directory!r} filled up while reserving {nbytes / 2**30:.2f} GiB for the "
                            f"{kind} tier of this rank: free space there or point nvme_path at a larger disk") from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise TierError(f"nvme_path {directory!r}: cannot reserve {nbytes} bytes for the {kind} tier: "
                            f"{e.strerror}") from e
        os.ftruncate(fd, nbytes)  # a filesystem without fallocate: space is taken as written


def made_everywhere(make, group):
    """make() on every rank of `group` (a collective): if it raised on any rank, every rank raises, so none goes
    on alone into a collective the failed one will not join."""
    out = error = None
    try:
        out = make()
    except Exception as e:  # noqa: BLE001 - handed to every rank
        error = e
    failed = first_failure(error, group)  # raises `error` here
    if failed:
        raise TierError(f"shardopt: rank {failed[0]} could not make its scratch files, so every rank stops: "
                        f"{failed[1]}")
    return out


def failed_anywhere(error: BaseException | None, group, what: str) -> None:
    """Raises on every rank of `group` if `error` is set on any (one small all-reduce when none is)."""
    if group is not None and dist.get_world_size(group) > 1:
        flag = torch.tensor([int(error is not None)])
        all_reduce(flag, group, f"{what} (did a rank's disk tier fail?)", op=dist.ReduceOp.MAX)
        if flag.item() and error is None:
            r, m = first_failure(None, group)
            raise TierError(f"shardopt: {what} failed on rank {r}, so every rank stops: {m}. Restart from the "
                            f"last checkpoint once its disk is fixed")
        if flag.item():
            first_failure(error, group)  # the peers learn of it, then it is raised here
    if error is not None:
        raise error
