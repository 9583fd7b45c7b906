"""The gradient shard on disk: a shared mapping of a scratch file, written back and dropped as the step goes.

Note [The gradient shard on disk]
---------------------------------
The bucket engine reduces each bucket into its chunk of one tensor (`shard_grad`) that norms, clipping, p.grad's
stand-ins and the step read in place. With offload="nvme" that tensor maps a file of its own (unnamed), so it
need not fit in memory: its pages are the file's page cache, which the kernel writes back and reclaims when
memory runs short (a capped job's cgroup first). Dirty pages are handed to writeback at the end of each backward
(`start_write_back`), and the step drops each bucket's pages once read (`drop`: MADV_DONTNEED, then
POSIX_FADV_DONTNEED, which frees the clean ones and writes the rest back), so between steps the shard holds
only pages on their way to disk, which the kernel frees when they get there, and the engine needs no change.
Gradients forgotten (zero_grad) are zeroed in the file itself (`forget`: FALLOC_FL_ZERO_RANGE, the blocks kept
reserved but marked unwritten), so the next backward's first write into a page finds zeros without reading
the old gradient back from disk.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time

import torch

from shardopt.tiers.disk import ALIGN, TierError, open_unnamed, reserve, round_up


_ZERO_RANGE = 0x10 | 0x01  # FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


class MappedShard:
    """`numel` elements of `dtype` in a file of `directory`, shown as one tensor (Note above)."""

    def __init__(self, directory: str, numel: int, dtype: torch.dtype):
        self.directory, self.dtype = directory, dtype
        self.nbytes = round_up(max(numel * dtype.itemsize, 1))
        self.fd = open_unnamed(directory, "gradient", direct=False)
        try:
            reserve(self.fd, self.nbytes, directory, "gradient")
            self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            self.fd = -1  # closed: __del__ has nothing to close
            raise
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)
        self.numel = numel
        self.zero_range = True  # FALLOC_FL_ZERO_RANGE works here (until it is refused once)
        self.exposed = 0.0  # seconds spent in drop()

    def drop(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) (rounded out to whole pages) out of this process, on their way to the file."""
        start = lo * self.dtype.itemsize // ALIGN * ALIGN
        end = min(round_up(hi * self.dtype.itemsize), self.nbytes)
        if end <= start:
            return
        t0 = time.perf_counter()
        try:  # unmapped, then handed to writeback: clean pages go now, dirty ones once written
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise TierError(f"shardopt: writing the gradient shard to its scratch file in {self.directory} failed: "
                            f"{e.strerror or e} (errno {e.errno}); check the disk behind nvme_path") from e
        finally:
            self.exposed += time.perf_counter() - t0

    def forget(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) read as zeros from now on: the whole pages inside zeroed in the file without I/O
        (Note above), the partial pages at either edge in place (all in place where the filesystem cannot)."""
        size = self.dtype.itemsize
        start = min(round_up(lo * size), hi * size)
        end = max(start, round_up(hi * size) if hi == self.numel else hi * size // ALIGN * ALIGN)
        if self.zero_range and end > start:
            if _libc.fallocate(self.fd, _ZERO_RANGE, start, end - start) == 0:
                self.tensor[lo:start // size].zero_()
                self.tensor[min(end // size, hi):hi].zero_()
                return
            err = ctypes.get_errno()
            if err not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise TierError(f"shardopt: zeroing the gradient shard's scratch file in {self.directory} failed: "
                                f"{os.strerror(err)} (errno {err}); check the disk behind nvme_path")
            self.zero_range = False
        self.tensor[lo:hi].zero_()

    def start_write_back(self) -> None:
        """Every dirty page handed to writeback, without waiting (clean pages are cheap for the kernel to drop)."""
        try:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise TierError(f"shardopt: writing the gradient shard back in {self.directory} failed: "
                            f"{e.strerror}") from e

    def __del__(self):  # the file goes once the tensor does too (the mapping keeps it)
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1
