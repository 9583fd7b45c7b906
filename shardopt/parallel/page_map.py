"""Pages of shared memory seen end to end at a new address, without copying a byte (Linux).

    t = map_spans([(buffer, start, numel), ...])   # a tensor over the spans, one after the other; None: cannot
    reference_spans([(buffer, start, numel), ...]) # what t holds, as a copy (torch.cat): the pure-PyTorch reference

Each `buffer` is a tensor over a MAP_SHARED mapping, each span whole pages on page boundaries. The new mapping
shares the pages (a write through either shows in both) and is unmapped with the last tensor over it.

Note [Mapping a shared mapping again]
-------------------------------------
mremap(old, 0, n, MREMAP_MAYMOVE | MREMAP_FIXED, new), old size 0, maps a shared mapping's pages again at
`new` with no file descriptor, which the files in /dev/shm no longer have once unlinked (Note [Gathering
through shared memory] in shared_memory.py). So n bytes of address space are reserved (PROT_NONE) and each
span mapped over its part. Any failure (not Linux, unaligned, the mapping limit) gives None: the caller copies.
"""
from __future__ import annotations

import ctypes
import mmap
import weakref

import torch

PAGE = mmap.PAGESIZE
_PROT_NONE, _MAP_PRIVATE, _MAP_ANONYMOUS = 0, 0x02, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_FAILED = ctypes.c_void_p(-1).value

_libc = None


def _lib():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mremap.restype = ctypes.c_void_p, ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


def map_spans(spans: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor | None:
    """One tensor over `spans` (buffer, first element, elements), end to end, sharing their pages; or None."""
    dtype = spans[0][0].dtype
    item = dtype.itemsize
    for buffer, start, numel in spans:
        if (buffer.dtype != dtype or buffer.device.type != "cpu" or (buffer.data_ptr() + start * item) % PAGE
                or (numel * item) % PAGE or start + numel > buffer.numel()):
            return None
    total = sum(numel for _, _, numel in spans) * item
    try:
        libc = _lib()
    except (OSError, AttributeError):
        return None
    base = libc.mmap(None, total, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if base in (None, _FAILED):
        return None
    at = base
    for buffer, start, numel in spans:
        n = numel * item
        if libc.mremap(buffer.data_ptr() + start * item, 0, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, at) != at:
            libc.munmap(base, total)
            return None
        at += n
    window = (ctypes.c_char * total).from_address(base)
    weakref.finalize(window, libc.munmap, base, total)  # once no tensor over it is left
    return torch.frombuffer(window, dtype=dtype)


def reference_spans(spans: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """What map_spans shows, as a copy."""
    return torch.cat([buffer[start:start + numel] for buffer, start, numel in spans])
