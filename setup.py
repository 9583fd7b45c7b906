"""Builds shardopt and its C++ extension shardopt._C against the installed torch.

    pip install torch==2.13.0
    pip install --no-build-isolation -e .

Sources: every csrc/**/*.cpp (and csrc/**/*.cu when torch has CUDA). SIMD kernels
are files named `<name>.<isa>.cpp` (isa in scalar/avx2/avx512/neon). Each of those
is compiled on its own with that ISA's flags and linked in; the choice among
them is made at run time (csrc/cpu_features.cpp). Never a -march for the build machine: the
binary must run on any CPU of its architecture.

Note [ISA translation units]: a `.<isa>.cpp` file includes no torch or STL
headers with inline functions. An inline function compiled with -mavx512f in
one object and without it in another is one symbol to the linker, which keeps
either copy; the AVX-512 one would then crash on older CPUs. Plain C++ types,
<immintrin.h>/<arm_neon.h> and <cstdint>/<cstddef> only.
"""
import glob
import os
import platform
import sys

from setuptools import find_packages, setup

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
from build_support.cuda_plan import CudaPlanError, gather_inputs, plan  # noqa: E402
from build_support.unity import plan_units, unit_count, write_units  # noqa: E402


def _plan_cuda():
    """Decides the CUDA half before anything compiles (Note [CUDA architectures without a GPU] in
    build_support/cuda_plan.py): sets CUDA_HOME and TORCH_CUDA_ARCH_LIST for torch's cpp_extension,
    which must be imported after, and prints one line saying what it chose."""
    try:
        cuda = plan(gather_inputs(torch))
    except CudaPlanError as e:
        sys.exit(f"error: shardopt cannot build its CUDA half: {e}")
    if cuda.message:
        print(cuda.message, file=sys.stderr, flush=True)
    if cuda.build_cuda:
        os.environ["CUDA_HOME"] = cuda.cuda_home
        if cuda.arch_list:
            os.environ["TORCH_CUDA_ARCH_LIST"] = cuda.arch_list
    return cuda.build_cuda


WITH_CUDA = _plan_cuda()
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402
MACHINE = platform.machine().lower()
IS_X86 = MACHINE in ("x86_64", "amd64")
IS_ARM = MACHINE in ("aarch64", "arm64")

# torch's headers need C++20 from 2.14 on (2.13's already use C++20 features,
# with warnings under C++17), so every file is C++20.
CXX_STD = "-std=c++20"

# Flags every translation unit gets. -fno-math-errno lets GCC vectorise sqrt
# (without it every sqrt is a scalar call that may set errno: 4x slower Adam).
# -ffp-contract=off: the generic kernels match their PyTorch references bit for
# bit (Note [The local momentum in one pass] in csrc/comm/onebit_codec.h), and a
# target with FMA in its baseline (aarch64) would otherwise fuse a*b+c.
COMMON_FLAGS = ["-O3", "-fno-math-errno", "-fvisibility=hidden", "-ffp-contract=off"]

# Flags of every ISA translation unit on top of COMMON_FLAGS. No contraction of
# a*b+c into FMA: kernels choose their instructions explicitly, and contraction
# would make the scalar variant's results depend on the target (aarch64 has FMA
# in its baseline), breaking the bitwise agreement between variants that
# tests/test_isa.py checks (Note [Adam operation order] in csrc/adam/adam_element.h).
ISA_COMMON_FLAGS = ["-ffp-contract=off"]

# Note [at::parallel_for needs -fopenmp]: torch's CPU wheel parallelises with
# OpenMP, and at::parallel_for is an inline template that only forks threads
# when the *including* file is compiled with OpenMP (_OPENMP defined); without
# it every kernel silently runs on one thread. Linking adds DT_NEEDED
# libgomp.so.1, which the loader matches by soname to the libgomp torch has
# already loaded (torch is imported first), so there is still one OpenMP
# runtime in the process (tests/test_isa.py checks both facts).
OPENMP_FLAGS = [] if sys.platform == "darwin" else ["-fopenmp"]

# Per-ISA flags, the same as CMakeLists.txt. A variant whose flags this
# architecture does not have is not built, and the dispatcher never offers it.
ISA_FLAGS = {"scalar": []}
if IS_X86:
    ISA_FLAGS["avx2"] = ["-mavx2", "-mfma", "-mf16c"]
    ISA_FLAGS["avx512"] = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
if IS_ARM:
    ISA_FLAGS["neon"] = []  # Advanced SIMD is baseline on aarch64.

ALL_ISAS = ("scalar", "avx2", "avx512", "neon")

# What the line printed before compiling says about the time (measured: README, Note [Unity build]).
BUILD_TIME = "about 200 CPU-seconds in all, a few minutes on 2 cores"


def _isa_of(path):
    parts = os.path.basename(path).split(".")
    return parts[-2] if len(parts) >= 3 and parts[-2] in ALL_ISAS else None


def _sources():
    cpp = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cpp = [p for p in cpp if not p.startswith(os.path.join("csrc", "tests"))]
    generic = [p for p in cpp if _isa_of(p) is None]
    isa = [p for p in cpp if _isa_of(p) in ISA_FLAGS]
    cuda = sorted(glob.glob(os.path.join("csrc", "cuda", "**", "*.cu"), recursive=True))
    return generic, isa, cuda


def _say(line):
    """Note [A line on the screen under pip]: pip shows a build's output only with -v (without it,
    "Building editable for shardopt (pyproject.toml) ... " and a spinner, or "still running..." once a
    minute when its output is not a terminal). So a line that must be seen while the extension compiles
    goes to stderr (pip -v, `setup.py build_ext`, CI logs) and, when stderr is not a terminal but the
    process has one (pip hiding the output in an interactive shell), to that terminal too."""
    print(line, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write("\n" + line + "\n")
    except OSError:
        pass  # no terminal (CI, Docker build): stderr only


class BuildExt(BuildExtension):
    """BuildExtension that first compiles each ISA file with its own flags, then the rest as a few
    unity units (Note [Unity build] in build_support/unity.py) and the CUDA sources as they are."""

    def build_extensions(self):
        for ext in self.extensions:
            units = getattr(ext, "unity_units", None)
            if units:
                grouped = {p for u in units for p in u}
                unit_files = write_units(units, os.path.join(self.build_temp, "unity"))
                ext.sources = unit_files + [s for s in ext.sources if s not in grouped]
            isa = getattr(ext, "isa_sources", [])
            _say(f"shardopt: compiling {ext.name}: {len(isa)} SIMD kernel files, then "
                 f"{_describe_units(units, ext)}, {_jobs()} at a time; {BUILD_TIME}")
            for src in isa:
                flags = [CXX_STD, "-fPIC"] + COMMON_FLAGS + ISA_COMMON_FLAGS + ISA_FLAGS[_isa_of(src)]
                objs = self.compiler.compile([src], output_dir=self.build_temp, extra_postargs=flags)
                ext.extra_objects.extend(objs)
        super().build_extensions()


def _pip_cuda_includes():
    """Headers of the CUDA libraries torch's pip wheels bring (nvidia/*/include).

    torch's CUDA headers include cuSPARSE/cuBLAS headers that a minimal CUDA
    toolkit may lack; the wheels that torch itself links against carry them.
    """
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(d for root in nvidia.__path__ for d in glob.glob(os.path.join(root, "*", "include")))


def _cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _jobs():
    """The parallel compiles torch's BuildExtension asks ninja for: MAX_JOBS, else ninja's own default."""
    env = os.environ.get("MAX_JOBS", "")
    return env if env.strip().isdigit() else f"ninja's default ({_cpus() + 2})"


def _describe_units(units, ext):
    n_cuda = sum(1 for s in ext.sources if s.endswith(".cu"))
    if units:
        cpp = f"{sum(len(u) for u in units)} C++ files as {len(units)} unity unit{'s' * (len(units) > 1)}"
    else:
        cpp = "each C++ file on its own (SHARDOPT_UNITY=0)"
    return cpp + (f" and {n_cuda} CUDA file{'s' * (n_cuda > 1)}" if n_cuda else "")


def _unity_units(generic):
    """Note [Unity build] in build_support/unity.py; SHARDOPT_UNITY=0: one file per unit (None)."""
    if os.environ.get("SHARDOPT_UNITY", "1") == "0":
        return None
    n = unit_count(os.environ.get("MAX_JOBS"), _cpus(), len(generic))
    return plan_units({p: os.path.getsize(p) for p in generic}, n)


def _extension():
    generic, isa, cuda = _sources()
    macros = [(f"SHARDOPT_HAVE_{name.upper()}", "1") for name in ISA_FLAGS]
    cxx = [CXX_STD] + COMMON_FLAGS + OPENMP_FLAGS
    if WITH_CUDA:
        macros.append(("SHARDOPT_WITH_CUDA", "1"))
        # No --use_fast_math: it makes division approximate and flushes
        # subnormal gradients to zero, and the kernels must match their references.
        ext = CUDAExtension("shardopt._C", generic + cuda, define_macros=macros,
                            include_dirs=_pip_cuda_includes(), extra_compile_args={"cxx": cxx, "nvcc": ["-O3", CXX_STD]},
                            extra_link_args=OPENMP_FLAGS)
    else:
        ext = CppExtension("shardopt._C", generic, define_macros=macros, extra_compile_args={"cxx": cxx},
                           extra_link_args=OPENMP_FLAGS)
    ext.isa_sources = isa
    ext.unity_units = _unity_units(generic)
    return ext


# The integrations' floors, each tested: .ci/run runs the tests that use them (the Trainer, Lightning,
# DeepSpeed interop and 1-bit Adam files) on exactly these (.venv-oldest) after the main suite, which
# gets the newest. transformers 5.0's Trainer needs accelerate 1.3 (1.1 and 1.2 lack
# get_module_size_with_ties and unwrap_model(keep_torch_compile=)), though 5.0 itself asks for >=1.1.0.
# Note [One ShardedTrainer for every transformers 5.x].
TRANSFORMERS = ["transformers>=5.0.0", "accelerate>=1.3.0"]
PEFT = "peft>=0.18.0"                   # LoRA on a sharded base (tests/test_weights.py, test_hf_trainer.py)
LIGHTNING = "lightning>=2.6.0"          # the strategy uses some of its internals: developed against 2.6
DEEPSPEED = "deepspeed>=0.19.0,<0.20"   # checkpoint formats as 0.19 writes them
# TRL: tests/test_trl.py on 1.0.0 (CI's .venv-oldest, with transformers 5.0.0 and accelerate 1.4.0, TRL 1.0's own
# floor) and 1.16.0, the newest (the main venv). 2.x not admitted: the generating trainers' path through
# ShardedTrainer (Note [Trainers that generate during training]) leans on how TRL 1.x unwraps and generates.
TRL = "trl>=1.0.0,<2"

setup(
    name="shardopt",
    version="0.1.0",
    description="ZeRO-style sharded optimizer for PyTorch with a fused CPU Adam",
    packages=find_packages(include=["shardopt", "shardopt.*"]),
    python_requires=">=3.10",
    # torch is deliberately not a hard requirement: an unpinned torch makes pip
    # pull a multi-GB CUDA build. Install the torch you want first, then build
    # this package against it with --no-build-isolation.
    install_requires=["numpy"],
    # Lightning is optional (shardopt.integrations.lightning); the tests cover it, so CI installs it.
    # matplotlib: the PNG charts of `shardopt tune` / `shardopt bench` (and their tests).
    # interop: DeepSpeed, whose ZeRO-1/2/3 checkpoints load_checkpoint reads (without it too); the
    # tests resume real DeepSpeed runs. Its install pulls no torch when torch is already there (pin it).
    # cmake: tests/test_cpp.py builds and runs the C++ tests of csrc/tests/ with CMakeLists.txt.
    extras_require={"lightning": [LIGHTNING], "bench": ["matplotlib"], "interop": [DEEPSPEED],
                    "transformers": TRANSFORMERS, "peft": [PEFT],
                    "test": ["pytest>=7", "pytest-timeout", "cmake>=3.18", LIGHTNING, "matplotlib", DEEPSPEED, PEFT, TRL] + TRANSFORMERS},
    entry_points={"console_scripts": ["shardopt=shardopt.tools.cli:main"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)
