"""Which CUDA kernels the sources define, and whether a built shardopt._C holds every one of them.

    python .ci/cuda_kernels.py SO_PATH [SRC_DIR]      # SRC_DIR default csrc/cuda

Called by .ci/check-cuda-build after the CUDA build. Prints one line per
kernel and exits 1 (naming what is missing) unless every `__global__`
function of SRC_DIR/*.cu is in the binary, with device code for the
architecture that was asked for.

Note [Proving a kernel is compiled in]
--------------------------------------
Nothing CUDA can run here, so "the kernel is there" is read off the binary:
  * host side: nvcc emits a launch stub `__device_stub__<mangled name>` for
    every kernel (every template instantiation) that its translation unit
    compiles, and registers it with the CUDA runtime under that name; the
    stub's statics stay in the symbol table even when it is inlined. A .cu
    left out of the build, compiled without SHARDOPT_WITH_CUDA, a kernel
    template never instantiated, or a kernel #if'ed away has no stub;
  * device side: the `.nv_fatbin` section holds one entry per translation
    unit x architecture; there must be a cubin (kind 2) for every
    architecture of TORCH_CUDA_ARCH_LIST, or the kernels would not load on
    those GPUs. When the cubin is stored uncompressed, each kernel's name must
    appear in it too (a compressed one is only counted).
The expected names come from the sources (a regex over comment-free text),
so adding a kernel that the build does not compile fails the check without
anyone editing a list.
"""
from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import tempfile

_GLOBAL = re.compile(
    r"\b__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(?:(?:static|inline)\s+)*void\s+"
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\(")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def kernels_in_source(text: str) -> list[str]:
    """Names of the `__global__` functions defined or declared in one .cu file's text."""
    return sorted(set(_GLOBAL.findall(_COMMENTS.sub(" ", text))))


def kernels_in_dir(src_dir: str) -> dict[str, str]:
    """{kernel name: file} over every .cu file under src_dir."""
    out = {}
    for root, _, files in os.walk(src_dir):
        for f in sorted(files):
            if f.endswith(".cu"):
                path = os.path.join(root, f)
                with open(path, encoding="utf-8") as fh:
                    for name in kernels_in_source(fh.read()):
                        out[name] = path
    return out


def demangle(symbols: list[str]) -> list[str]:
    """c++filt over every symbol (one call); names it cannot demangle come back as they were."""
    if not symbols:
        return []
    out = subprocess.run(["c++filt"], input="\n".join(symbols), check=True, capture_output=True,
                         text=True).stdout.split("\n")
    return out[:len(symbols)]


_STUB = "__device_stub__"


def stub_names(symbols: list[str]) -> set[str]:
    """The distinct kernel launch stubs named anywhere in a list of raw symbols.

    nvcc names a kernel's host stub __device_stub__ + the kernel's mangled name
    without its leading underscore (or + the plain name of an extern "C"
    kernel). At -O3 the stub itself is inlined into its launch site and only its
    static locals stay in the symbol table, e.g.
    `_ZZL113__device_stub__ZN8shardopt..14unscale_kernelIfffE...E8__handle`: the
    stub's name is the <length> characters from `__device_stub__` on.
    """
    out = set()
    for sym in symbols:
        i = sym.find(_STUB)
        if i < 0:
            continue
        length = re.search(r"(\d+)$", sym[:i])
        if length:
            out.add(sym[i:i + int(length.group(1))])
        elif i == 0:
            out.add(sym)
    return out


def stubs_of(name: str, symbols: list[str]) -> list[str]:
    """The host launch stubs of kernel `name` (one per instantiation) among raw symbols.

    Matches the demangled kernel name, not the mangled text, so that `unscale`
    does not match `unscale_kernel`.
    """
    stubs = sorted(stub_names(symbols))
    bare = [s[len(_STUB):] for s in stubs]
    readable = demangle(["_" + b if b.startswith("Z") else b for b in bare])
    pat = re.compile(rf"(?:^|[\s:*&]){re.escape(name)}(?:$|[<(])")
    return [s for s, r in zip(stubs, readable) if pat.search(r)]


def fatbin_entries(blob: bytes) -> list[dict]:
    """Entries of a `.nv_fatbin` section: kind (1 PTX, 2 cubin), sm arch, compressed flag, payload.

    The section is a sequence of fat binaries (one per translation unit with
    device code), each a 16-byte header (magic 0xBA55ED50, version, header
    size, size of the entries) followed by entries, each with its own header.
    """
    out, at = [], 0
    while at + 16 <= len(blob):
        magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", blob, at)
        if magic != 0xBA55ED50:
            at += 8  # fat binaries are 8-byte aligned; skip padding
            continue
        pos, end = at + hsize, at + hsize + fsize
        while pos + 64 <= end:
            kind, _, ehsize, size = struct.unpack_from("<HHIQ", blob, pos)
            arch = struct.unpack_from("<I", blob, pos + 28)[0]
            flags = struct.unpack_from("<Q", blob, pos + 40)[0]
            if ehsize == 0:
                break
            out.append({"kind": kind, "arch": arch, "compressed": bool(flags & 0x2000),
                        "payload": blob[pos + ehsize:pos + ehsize + size]})
            pos += ehsize + size
        at = end
    return out


def in_cubin(name: str, cubin: bytes) -> bool:
    """Whether a cubin's string table names kernel `name`: mangled (<length><name>) or plain (extern "C").

    Not a bare substring search: `scale_kernel` is inside `unscale_kernel`,
    but `12scale_kernel` is not inside `14unscale_kernel`.
    """
    n = name.encode()
    return b"%d%s" % (len(n), n) in cubin or b"\x00%s\x00" % n in cubin


def _section(so_path: str, name: str) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "section")
        subprocess.run(["objcopy", "-O", "binary", f"--only-section={name}", so_path, out], check=True)
        with open(out, "rb") as fh:
            return fh.read()


def _wanted_archs() -> list[int]:
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    return sorted({int(a.split("+")[0].replace(".", "")) for a in re.split(r"[;\s]+", archs) if a[:1].isdigit()})


def check(so_path: str, src_dir: str) -> list[str]:
    """Problems found (empty: every kernel of the sources is in the binary); prints one line per kernel."""
    kernels = kernels_in_dir(src_dir)
    if not kernels:
        return [f"no __global__ function found under {src_dir}: nothing would prove the CUDA build"]
    symbols = subprocess.run(["nm", "--defined-only", so_path], check=True, capture_output=True,
                             text=True).stdout.split()
    entries = fatbin_entries(_section(so_path, ".nv_fatbin"))
    cubins = [e for e in entries if e["kind"] == 2]
    problems = []
    for arch in _wanted_archs():
        if not any(e["arch"] == arch for e in cubins):
            problems.append(f"no sm_{arch} device code in {os.path.basename(so_path)} "
                            "(TORCH_CUDA_ARCH_LIST asked for it)")
    plain = [e["payload"] for e in cubins if not e["compressed"]]
    so_name = os.path.basename(so_path)
    for name, path in sorted(kernels.items()):
        stubs = stubs_of(name, symbols)
        device = any(in_cubin(name, p) for p in plain) if plain else None  # None: cannot tell (compressed)
        print(f"  {name:<28} {path:<26} {len(stubs)} instantiation(s)"
              + ("" if device is None else f", device code {'yes' if device else 'MISSING'}"))
        if not stubs:
            problems.append(f"kernel {name} ({path}) is not in {so_name}: no launch stub, so it was not "
                            "compiled (a .cu left out of the build, SHARDOPT_WITH_CUDA unset, or a template "
                            "never instantiated)")
        elif device is False:
            problems.append(f"kernel {name} ({path}) has a host stub but no device code in {so_name}")
    archs = sorted({e["arch"] for e in cubins})
    print(f"  device code: {len(cubins)} cubin(s) for sm_{', sm_'.join(map(str, archs)) or '-'}"
          f"{' (compressed)' if cubins and not plain else ''}")
    return problems


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    problems = check(argv[0], argv[1] if len(argv) > 1 else os.path.join("csrc", "cuda"))
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
