"""The CUDA sources' contract, checked without a GPU.

Every csrc/cuda/*.cu names its pure-PyTorch reference (a function of
shardopt.reference, which the CPU kernel of the same op is tested against:
test_mixed_precision.py), registers only ops that also have a CPU kernel, and
defines kernels that .ci/check-cuda-build can find: that script reads the
expected kernel names from the sources with the parser tested here, and fails
if any is missing from the CUDA build's binary.
"""
import glob
import importlib.util
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "**", "*.cu"), recursive=True))


def _kernels_module():
    spec = importlib.util.spec_from_file_location("cuda_kernels", os.path.join(ROOT, ".ci", "cuda_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_names_are_read_from_sources():
    k = _kernels_module()
    src = """
    template <typename T> __global__ void plain(T* x) {}
    __global__ __launch_bounds__(256) void bounded(float* x) {}
    __global__ void __launch_bounds__(128, 2) bounded_after(float* x) {}
    static __global__ void local_one(int n);
    extern "C" __global__ void c_linkage() {}
    // __global__ void commented_out() {}
    /* __global__ void also_commented(int) {} */
    __device__ float helper(float x) { return x; }
    """
    assert k.kernels_in_source(src) == ["bounded", "bounded_after", "c_linkage", "local_one", "plain"]
    # Host stubs as nvcc names them: __device_stub__ + the mangled kernel without its
    # leading underscore (or + a plain extern "C" name). Inlined at -O3, a stub leaves
    # only its statics (__handle, a guard): one stub per instantiation, however many symbols.
    # (Symbols of a CUDA build of csrc/cuda/unscale.cu; the namespace hash is nvcc's.)
    ns = "ZN8shardopt48_GLOBAL__N__df35415c_10_unscale_cu_4c1a58f5_9856"
    fff = f"__device_stub__{ns}14unscale_kernelIfffEEvPKT_PT0_lT1_Pf"
    hff = f"__device_stub__{ns}14unscale_kernelIN3c104HalfEffEEvPKT_PT0_lT1_Pf"
    syms = [f"_ZZL{len(fff)}{fff}PKfPflfS1_E8__handle", f"_ZGVZL{len(fff)}{fff}PKfPflfS1_E5__tmp",
            f"_ZZL{len(hff)}{hff}PKN3c104HalfEPflfS3_E8__handle",
            "_Z24__device_stub__c_linkagev",
            f"_{ns}14unscale_kernelIfffEEvPKT_PT0_lT1_Pf",                  # the kernel, not a stub
            "_ZZL36__device_stub__ZN8shardopt7unscaleEvE8__handle"]          # another kernel
    assert k.stubs_of("unscale_kernel", syms) == sorted([fff, hff])
    assert k.stubs_of("unscale", syms) == ["__device_stub__ZN8shardopt7unscaleEv"]
    assert k.stubs_of("c_linkage", syms) == ["__device_stub__c_linkage"]
    assert k.stubs_of("missing", syms) == []
    # Device code: a cubin's string table holds the mangled names (or plain extern "C" ones).
    cubin = b"\x00_ZN8shardopt12_GLOBAL__N_114unscale_kernelIfffEEvPKT_\x00c_linkage\x00"
    assert k.in_cubin("unscale_kernel", cubin) and k.in_cubin("c_linkage", cubin)
    assert not k.in_cubin("scale_kernel", cubin) and not k.in_cubin("linkage", cubin)


@pytest.mark.parametrize("path", CUDA_SOURCES, ids=lambda p: os.path.relpath(p, ROOT))
def test_each_cuda_source_has_a_reference_and_a_cpu_kernel(path):
    import shardopt  # noqa: F401  (registers the ops)
    from shardopt import reference

    k = _kernels_module()
    text = open(path, encoding="utf-8").read()
    assert k.kernels_in_source(text), f"{path} defines no __global__ kernel"
    refs = set(re.findall(r"shardopt\.reference\.(\w+)", text))
    assert refs, f"{path} must name its pure-PyTorch reference (shardopt.reference.<name>) in its header"
    for name in refs:
        assert callable(getattr(reference, name, None)), f"{path} names shardopt.reference.{name}, which is missing"
    ops = re.findall(r'm\.impl\(\s*"(\w+)"', text)
    assert ops, f"{path} registers no op for the CUDA dispatch key"
    for op in ops:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"shardopt::{op}", "CPU"), \
            f"shardopt::{op} has a CUDA kernel ({path}) but no CPU kernel to test against its reference"
        assert f"{op}_reference" in refs, f"{path} implements {op}: its reference must be {op}_reference"


def test_cpu_build_has_no_cuda_kernels_registered():
    """This machine's build: the CUDA half is absent, so CPU tests never take it for granted."""
    import shardopt  # noqa: F401
    from shardopt import _ext

    if torch.version.cuda is None:
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("shardopt::unscale_into", "CUDA")
        assert _ext._C.default_copy_device() is None
