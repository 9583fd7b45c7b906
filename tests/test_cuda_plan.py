"""setup.py's CUDA plan (build_support/cuda_plan.py) as a table: made-up machines in, the plan out.

No GPU, CUDA torch or nvcc needed: Note [CUDA architectures without a GPU] and Note [Finding CUDA_HOME]
there say what each row stands for. .ci/check-cuda-build builds for real (one architecture); the
no-GPU default was built once by hand (docs/cuda.md).
"""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("cuda_plan", os.path.join(ROOT, "build_support", "cuda_plan.py"))
cuda_plan = importlib.util.module_from_spec(_spec)
sys.modules["cuda_plan"] = cuda_plan  # dataclasses look their module up there
_spec.loader.exec_module(cuda_plan)

# torch 2.14.1+cu130's own list, and CUDA 13.0's nvcc --list-gpu-code (both read on this machine).
WHEEL = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
NVCC_13 = ["sm_75", "sm_80", "sm_86", "sm_87", "sm_88", "sm_89", "sm_90", "sm_100", "sm_110", "sm_103",
           "sm_120", "sm_121"]
TOOLKIT = "/usr/local/cuda-13.0"


def machine(**kw):
    """A CUDA torch without a GPU, nvcc through a wrapper in /usr/local/bin (this machine), unless told."""
    base = dict(torch_version="2.14.1+cu130", torch_cuda="13.0", nvcc_on_path="/usr/local/bin/nvcc",
                nvcc_top=TOOLKIT, nvcc_version="13.0", nvcc_codes=NVCC_13, torch_archs=WHEEL, visible_gpus=0,
                has_headers=lambda home: home in (TOOLKIT, "/opt/cuda", "/usr/local/cuda"))
    base.update(kw)
    return cuda_plan.CudaInputs(**base)


def test_no_gpu_and_no_list_builds_for_what_torch_was_built_for():
    p = cuda_plan.plan(machine())
    assert (p.build_cuda, p.cuda_home, p.arch_list) == (True, TOOLKIT, "7.5;8.0;8.6;9.0;10.0;12.0+PTX")
    assert "no GPU visible" in p.message and "TORCH_CUDA_ARCH_LIST" in p.message and "SHARDOPT_NO_CUDA=1" in p.message


def test_architectures_nvcc_cannot_compile_are_left_out():
    # An older nvcc than the wheel's (same major): the newest torch architecture is dropped, the PTX moves down.
    p = cuda_plan.plan(machine(nvcc_codes=["sm_75", "sm_80", "sm_86", "sm_90"]))
    assert p.arch_list == "7.5;8.0;8.6;9.0+PTX"
    # nvcc could not list its codes (an old nvcc without --list-gpu-code): torch's list as it is.
    assert cuda_plan.plan(machine(nvcc_codes=None)).arch_list == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    # Arch-specific entries (sm_90a) are not default targets; "sm_100" is 10.0, not 1.00.
    assert cuda_plan.plan(machine(torch_archs=["sm_90a", "sm_100"])).arch_list == "10.0+PTX"


@pytest.mark.parametrize("env", ["8.0", "8.0;9.0+PTX", "Hopper"])
def test_a_given_list_is_used_as_given(env):
    p = cuda_plan.plan(machine(arch_list_env=env))
    assert (p.build_cuda, p.arch_list) == (True, None)  # None: the environment's value stays, torch reads it
    assert env in p.message


@pytest.mark.parametrize("env", [None, "native"])
def test_a_visible_gpu_leaves_the_choice_to_torch(env):
    p = cuda_plan.plan(machine(visible_gpus=2, arch_list_env=env))
    assert (p.build_cuda, p.arch_list) == (True, None) and "visible" in p.message


@pytest.mark.parametrize("kw, words", [
    (dict(arch_list_env="native"), "native needs a visible GPU"),
    (dict(torch_archs=[]), "does not say which architectures"),
    (dict(nvcc_codes=["sm_50", "sm_52"]), "compiles for none of them"),
    (dict(nvcc_version="12.8"), "major versions must agree"),
])
def test_what_cannot_be_planned_fails_before_compiling_with_the_way_out(kw, words):
    with pytest.raises(cuda_plan.CudaPlanError, match=words) as e:
        cuda_plan.plan(machine(**kw))
    assert "SHARDOPT_NO_CUDA=1" in str(e.value)


def test_cpu_builds():
    assert cuda_plan.plan(machine(torch_cuda=None)) == cuda_plan.CudaPlan(False)  # a CPU wheel: silent
    p = cuda_plan.plan(machine(no_cuda_env="1"))
    assert not p.build_cuda and "CPU-only" in p.message
    # A CUDA torch and no toolkit anywhere: the CPU half, said so (torch's own rule, now with a line).
    p = cuda_plan.plan(machine(nvcc_on_path=None, nvcc_top=None, has_headers=lambda home: False))
    assert not p.build_cuda and "no CUDA toolkit" in p.message


@pytest.mark.parametrize("kw, home", [
    (dict(), TOOLKIT),                                                      # wrapper on PATH: nvcc's own TOP
    (dict(nvcc_on_path=TOOLKIT + "/bin/nvcc"), TOOLKIT),                    # the real nvcc on PATH: torch's guess
    (dict(nvcc_top=None), "/usr/local/cuda"),                               # wrapper, TOP unknown: the usual place
    (dict(nvcc_on_path=None, nvcc_top=None), "/usr/local/cuda"),            # no nvcc on PATH: torch's guess too
    (dict(cuda_home_env="/opt/cuda"), "/opt/cuda"),                         # CUDA_HOME set: the user's choice
])
def test_cuda_home(kw, home):
    assert cuda_plan.plan(machine(**kw)).cuda_home == home
