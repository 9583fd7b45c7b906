"""Pages of shared memory seen end to end at a new address, without copying a byte (Linux).

    t = map_spans([(buffer, start, numel), ...])   # a tensor over the spans, one after the other; None: cannot
    reference_spans([(buffer, start, numel), ...]) # what t holds, as a copy (torch.cat): the pure-PyTorch reference

Each `buffer` is a tensor over a MAP_SHARED mapping (torch.from_file(..., shared=True)), every span starts on a
page boundary of it and is whole pages long. The new mapping shares the pages themselves: a write through either
is seen through the other. It is unmapped when the last tensor over it is gone.

Note [Mapping a shared mapping again]
-------------------------------------
mremap(old, 0, n, MREMAP_MAYMOVE | MREMAP_FIXED, new) with an old size of 0 makes a second mapping of a shared
mapping's pages at `new` (mremap(2)): no file descriptor is needed, which matters here as the files in /dev/shm
are unlinked once every rank mapped them (Note [Gathering through shared memory] in shared_flat.py). So n bytes
of address space are reserved (an anonymous PROT_NONE mapping) and each span is moved over its part of it.
Page-table entries are filled on first touch; afterwards reading the new mapping costs what reading the old one
does. Any failure (not Linux, a span not page-aligned, the kernel's mapping limit) gives None and the caller
copies instead.
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
    """One tensor over `spans` (buffer, first element, elements), end to end, sharing their pages; None if the
    kernel would not (Note [Mapping a shared mapping again])."""
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
