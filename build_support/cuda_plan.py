"""What setup.py decides before it compiles the CUDA half: where CUDA is, and for which GPU architectures.

Pure functions of their inputs (environment values, what torch reports, what nvcc reports), so that
tests/test_cuda_plan.py can feed them every case without a GPU, a CUDA torch or nvcc; setup.py gathers
the inputs (`gather_inputs`) and applies the plan. Nothing here imports torch.utils.cpp_extension:
the CUDA home it finds must be in the environment *before* that import (torch reads CUDA_HOME once).

Note [CUDA architectures without a GPU]
torch's cpp_extension, when TORCH_CUDA_ARCH_LIST is unset (or "native"), builds for the GPUs it sees.
With none visible (a Docker build step, a CPU CI runner, a login node) its list is empty and it fails
with `IndexError: list index out of range` in `_get_cuda_arch_flags` (torch 2.13 and 2.14), and in our
build only after the SIMD files have compiled, minutes in. So setup.py plans first:
  - TORCH_CUDA_ARCH_LIST set to a list: used as given (torch checks the names).
  - no list (or "native") and a GPU visible: torch's own choice (the visible GPUs), as before.
  - no list and no GPU: the architectures the installed torch was built for (`torch.cuda.get_arch_list()`,
    which reads the build's flags and needs no GPU in 2.14; torch._C._cuda_getArchFlags() otherwise),
    less those this nvcc cannot compile for, the newest also as PTX (so newer GPUs JIT it). An extension
    built so runs wherever that torch runs. One line says which, and how to choose.
  - "native" and no GPU, nothing usable from torch, or no architecture both torch and nvcc know: a
    clear error before anything compiles, naming the two ways out (TORCH_CUDA_ARCH_LIST,
    SHARDOPT_NO_CUDA=1).
The cost of the full list is small here: one .cu file (csrc/cuda/) has device code; the other files
compile once whatever the list.

Note [Finding CUDA_HOME]
torch takes CUDA_HOME (or CUDA_PATH) from the environment, else the folder above the `nvcc` on PATH.
Where that nvcc is a wrapper script (here /usr/local/bin/nvcc execs /usr/local/cuda-13.0/bin/nvcc)
the folder above it, /usr/local, has no CUDA headers or libraries, and the build fails late. When the
home torch would take has no include/cuda_runtime_api.h, the plan takes the toolkit nvcc reports for
itself (`nvcc --dryrun` of a compile prints `#$ TOP=<toolkit>/bin/..`), else /usr/local/cuda, if that one has it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

HOW_TO_CHOOSE = ("set TORCH_CUDA_ARCH_LIST (e.g. \"8.0;9.0\") to choose the architectures, "
                 "or SHARDOPT_NO_CUDA=1 for a CPU-only build")


class CudaPlanError(RuntimeError):
    """The CUDA half cannot be planned: raised before anything compiles, with what to do."""


@dataclass
class CudaInputs:
    """Everything the plan depends on, gathered by `gather_inputs` (or made up by a test)."""
    torch_version: str
    torch_cuda: str | None                 # torch.version.cuda: None for a CPU wheel
    no_cuda_env: str | None = None         # SHARDOPT_NO_CUDA
    arch_list_env: str | None = None       # TORCH_CUDA_ARCH_LIST
    cuda_home_env: str | None = None       # CUDA_HOME, else CUDA_PATH
    nvcc_on_path: str | None = None        # shutil.which("nvcc")
    nvcc_top: str | None = None            # the toolkit nvcc reports for itself (`nvcc --dryrun`)
    nvcc_version: str | None = None        # "13.0"
    nvcc_codes: list[str] | None = None    # nvcc --list-gpu-code: ["sm_75", ...]; None if unknown
    torch_archs: list[str] = field(default_factory=list)  # ["sm_75", "sm_80", ...] the wheel was built for
    visible_gpus: int = 0
    has_headers: object = None             # callable(home) -> bool: home/include/cuda_runtime_api.h exists


@dataclass
class CudaPlan:
    build_cuda: bool
    cuda_home: str | None = None           # to put in os.environ["CUDA_HOME"] before importing cpp_extension
    arch_list: str | None = None           # to put in os.environ["TORCH_CUDA_ARCH_LIST"]; None: leave as is
    message: str | None = None             # the one line to print


def _sm_number(code: str) -> tuple[int, int] | None:
    """"sm_90" -> (9, 0), "sm_100" -> (10, 0), "sm_90a" -> None (arch-specific, not a default target)."""
    m = re.fullmatch(r"sm_(\d+)(\d)", code)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _cuda_home(inp: CudaInputs) -> str | None:
    """The toolkit to build with (Note [Finding CUDA_HOME]); None if there is none."""
    has = inp.has_headers or (lambda home: os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")))
    if inp.cuda_home_env:
        return inp.cuda_home_env  # the user's choice, as torch takes it
    torch_guess = os.path.dirname(os.path.dirname(inp.nvcc_on_path)) if inp.nvcc_on_path else "/usr/local/cuda"
    for home in (torch_guess, inp.nvcc_top, "/usr/local/cuda"):
        if home and has(home):
            return os.path.normpath(home)
    return None


def plan(inp: CudaInputs) -> CudaPlan:
    """Whether to build the CUDA half, against which toolkit, for which architectures, and what to say."""
    if inp.no_cuda_env == "1":
        return CudaPlan(False, message="shardopt: CPU-only build (SHARDOPT_NO_CUDA=1)")
    if inp.torch_cuda is None:
        return CudaPlan(False)  # a CPU torch: nothing to say, nothing CUDA to build
    home = _cuda_home(inp)
    if home is None:
        return CudaPlan(False, message=f"shardopt: torch {inp.torch_version} has CUDA but no CUDA toolkit was "
                                       "found (no nvcc with headers; set CUDA_HOME): building the CPU half only")
    major = inp.torch_cuda.split(".")[0]
    if inp.nvcc_version and inp.nvcc_version.split(".")[0] != major:
        raise CudaPlanError(f"torch {inp.torch_version} was built with CUDA {inp.torch_cuda} but the nvcc in {home} "
                            f"is CUDA {inp.nvcc_version}; the major versions must agree. Set CUDA_HOME to a CUDA "
                            f"{major}.x toolkit, or SHARDOPT_NO_CUDA=1 for a CPU-only build")
    env = (inp.arch_list_env or "").strip()
    if env and env != "native":
        return CudaPlan(True, home, None, f"shardopt: building the CUDA half for TORCH_CUDA_ARCH_LIST={env}")
    if inp.visible_gpus > 0:
        return CudaPlan(True, home, None, f"shardopt: building the CUDA half for the {inp.visible_gpus} visible "
                                          f"GPU(s)' architectures (torch's choice); {HOW_TO_CHOOSE}")
    if env == "native":
        raise CudaPlanError(f"TORCH_CUDA_ARCH_LIST=native needs a visible GPU and none is; {HOW_TO_CHOOSE}")
    built = sorted({n for n in map(_sm_number, inp.torch_archs) if n})
    if not built:
        raise CudaPlanError(f"no GPU is visible and torch {inp.torch_version} does not say which architectures "
                            f"it was built for; {HOW_TO_CHOOSE}")
    usable = built
    if inp.nvcc_codes is not None:
        known = {n for n in map(_sm_number, inp.nvcc_codes) if n}
        usable = [n for n in built if n in known]
        if not usable:
            raise CudaPlanError(f"no GPU is visible; torch {inp.torch_version} was built for "
                                f"{', '.join(inp.torch_archs)} and the nvcc in {home} compiles for none of them "
                                f"({', '.join(inp.nvcc_codes)}); {HOW_TO_CHOOSE}")
    archs = [f"{a}.{b}" for a, b in usable]
    archs[-1] += "+PTX"
    arch_list = ";".join(archs)
    return CudaPlan(True, home, arch_list,
                    f"shardopt: no GPU visible: building the CUDA half for {arch_list} (what torch "
                    f"{inp.torch_version} was built for); {HOW_TO_CHOOSE}")


def _run(cmd: list[str]) -> str | None:
    """The command's stdout and stderr (nvcc's --dryrun writes to stderr); None if it could not run."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout + out.stderr if out.returncode == 0 else None


def gather_inputs(torch) -> CudaInputs:
    """What this machine says (setup.py's side of the plan). Imports nothing from cpp_extension."""
    inp = CudaInputs(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                     no_cuda_env=os.environ.get("SHARDOPT_NO_CUDA"),
                     arch_list_env=os.environ.get("TORCH_CUDA_ARCH_LIST"),
                     cuda_home_env=os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"),
                     nvcc_on_path=shutil.which("nvcc"))
    if inp.torch_cuda is None or inp.no_cuda_env == "1":
        return inp
    nvcc = os.path.join(inp.cuda_home_env, "bin", "nvcc") if inp.cuda_home_env else (inp.nvcc_on_path or "nvcc")
    dry = _run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull]) or ""
    dry += _run([nvcc, "--version"]) or ""
    m = re.search(r"^#\$ TOP=(\S+)", dry, re.M)
    inp.nvcc_top = os.path.normpath(m.group(1)) if m else None
    m = re.search(r"release (\d+\.\d+)", dry)
    inp.nvcc_version = m.group(1) if m else None
    codes = _run([nvcc, "--list-gpu-code"])
    inp.nvcc_codes = codes.split() if codes else None
    inp.visible_gpus = torch.cuda.device_count()
    archs = list(torch.cuda.get_arch_list())
    if not archs and hasattr(torch._C, "_cuda_getArchFlags"):
        archs = torch._C._cuda_getArchFlags().split()
    inp.torch_archs = archs
    return inp
