"""What a Hugging Face weights folder holds: file names, safetensors' dtype codes and byte layout.

Shared by reader.py and writer.py. Safetensors are little-endian and so is every host torch runs on;
this code assumes it.
"""
from __future__ import annotations

import os

import torch

from shardopt.files import dtype_name

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
# A .safetensors file is:
#   bytes [0, 8)        N, the header's length (unsigned 64-bit little-endian)
#   bytes [8, 8 + N)    UTF-8 JSON {"__metadata__": {str: str}, name: {"dtype": "BF16", "shape": [2, 3],
#                       "data_offsets": [begin, end]}, ...}, space-padded so that 8 + N is a multiple of 8
#   bytes [8 + N, end)  the data: tensor `name` at [8 + N + begin, 8 + N + end), row-major, little-endian;
#                       the tensors' ranges tile the data with no hole and no overlap
# The header is known before any value (dtypes and shapes fix byte counts, our order fixes each begin), so
# the writer writes it first and sets the file's size; then elements [lo, hi) of tensor t, of itemsize s,
# are bytes [start(t) + lo * s, start(t) + hi * s), start(t) = 8 + N + begin(t): one pwrite, at no shared
# file position, so pieces come in any order and the writer holds only headers. An unwritten range would
# read back as zeros in a valid-looking file, so the writer counts every element (_Coverage), refuses a
# second write of one, and commit refuses a hole. Reading is the same arithmetic, one pread.
# Tensors go largest itemsize first (else in the caller's order): with 8 + N a multiple of 8 and itemsizes
# powers of 2, every tensor starts aligned to its itemsize, so a reader may map it in place.


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


# ----------------------------------------------------------- bytes
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
