"""Every SIMD variant this CPU can run gives the same bits as the scalar one.

Bitwise, not within a tolerance: all variants do the same correctly rounded
fp32 operations (mul, add, div, sqrt) in the same order, never FMA, and the
ISA files are built with -ffp-contract=off (Note [Adam operation order] in
csrc/adam/adam_element.h). The bf16/fp16 copies are exact conversions too.
"""
import contextlib
import os

import pytest
import torch

import shardopt
from shardopt import _C
from shardopt.cpu_adam import fused_adam_step

SUPPORTED = shardopt.cpu_features()["supported"]
# Run again under every other variant this CPU runs (tests/test_isa_variants.py).
pytestmark = pytest.mark.isa_kernels

# Sizes around the 4-, 8- and 16-wide vector bodies so every variant runs its
# scalar tail, plus the three large tensors of SPLIT_SIZES.
TAIL_SIZES = [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 1023]
# With 2 threads the single parallel pass cuts the 210,009 elements (rounded
# up to 16-element units) at element 105,008, inside the second tensor
# (elements 70,001..140,003): one tensor is split between two threads at
# offset 35,007 of that tensor, not a multiple of any vector width, so the
# second thread's vector loop starts mid-tensor. The sizes are odd, so every
# tensor also ends in a scalar tail.
SPLIT_SIZES = [70_001, 70_003, 70_005]


@contextlib.contextmanager
def forced_isa(name):
    _C.set_isa_override(name)
    try:
        assert shardopt.cpu_features()["active"] == name
        yield
    finally:
        _C.set_isa_override("")


@contextlib.contextmanager
def threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run(isa, sizes, *, adamw, weight_decay, lowp_dtype, steps=3):
    gen = torch.Generator().manual_seed(42)
    params = [torch.randn(n, generator=gen) for n in sizes]
    m = [torch.zeros(n) for n in sizes]
    v = [torch.zeros(n) for n in sizes]
    lowp = [torch.empty(n, dtype=lowp_dtype) for n in sizes] if lowp_dtype else None
    with forced_isa(isa), threads(2):
        for step in range(1, steps + 1):
            grads = [torch.randn(n, generator=gen) for n in sizes]
            fused_adam_step(params, grads, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=weight_decay, adamw=adamw, step=step, lowp_out=lowp)
    return params + m + v + (lowp or [])


def test_scalar_and_a_vector_variant_are_available():
    # On x86-64 and aarch64 at least one SIMD variant must be offered, or this
    # file would compare scalar with itself.
    assert SUPPORTED[0] == "scalar" and len(SUPPORTED) >= 2, SUPPORTED
    # The process runs the best variant, or the one SHARDOPT_ISA pins (tests/test_isa_variants.py pins each).
    want = os.environ.get("SHARDOPT_ISA") or SUPPORTED[-1]
    assert shardopt.cpu_features()["active"] == shardopt.cpu_features()["best"] == want


@pytest.mark.parametrize("isa", [i for i in SUPPORTED if i != "scalar"])
@pytest.mark.parametrize("mode", ["adamw", "l2", "no_decay"])
@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16, torch.float16])
def test_variant_matches_scalar_bitwise(isa, mode, lowp_dtype):
    kw = dict(adamw=mode == "adamw", weight_decay=0.0 if mode == "no_decay" else 0.1, lowp_dtype=lowp_dtype)
    sizes = TAIL_SIZES + SPLIT_SIZES
    want = run("scalar", sizes, **kw)
    got = run(isa, sizes, **kw)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{isa} differs from scalar in output tensor {i} ({a.numel()} elements)"


def conversion_inputs():
    """fp32 values that probe every branch of fp32 -> bf16/fp16 rounding."""
    gen = torch.Generator().manual_seed(7)
    # Random bit patterns of every exponent (excluding NaN, whose payload
    # torch's own conversions do not agree on).
    bits = torch.randint(0, 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    x = torch.cat([x, -x])
    special = [
        0.0, -0.0, float("inf"), float("-inf"), 65504.0, 65519.99, 65520.0, 65536.0, 1e30,
        2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -26, 1.5 * 2.0 ** -24,
        2.5 * 2.0 ** -24, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8,
        3.3895314e38,  # rounds to bf16 infinity
    ]
    return torch.cat([x, torch.tensor(special), -torch.tensor(special)])


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_conversion_matches_torch(isa, dtype):
    # lr = 0, zero state and grad leave the param bit-identical (p - 0 / eps),
    # so the copy is a pure conversion of the input values.
    x = conversion_inputs()
    p = x.clone()
    out = torch.empty(x.numel(), dtype=dtype)
    with forced_isa(isa):
        fused_adam_step([p], [torch.zeros_like(x)], [torch.zeros_like(x)], [torch.zeros_like(x)], lr=0.0,
                        beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, step=1, lowp_out=[out])
    assert torch.equal(p.view(torch.int32), x.view(torch.int32))
    want = x.to(dtype)
    bad = (out.view(torch.int16) != want.view(torch.int16)).nonzero().flatten()
    assert bad.numel() == 0, f"{isa}: {bad.numel()} mismatches, first {x[bad[:5]].tolist()}"


def test_override_is_validated_and_restored():
    with pytest.raises(RuntimeError, match="unknown ISA"):
        _C.set_isa_override("sse9")
    with forced_isa("scalar"):
        pass
    assert shardopt.cpu_features()["active"] == shardopt.cpu_features()["best"]


def test_kernels_are_built_to_run_on_torchs_thread_pool():
    """at::parallel_for only forks threads in files compiled with OpenMP; without it every kernel
    silently ran on one thread (Note [at::parallel_for needs -fopenmp] in setup.py). And the
    extension must share torch's OpenMP runtime, not load a second one that spins against it."""
    from shardopt import _C

    assert _C.intra_op_parallel()
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(gomp) <= 1, f"more than one OpenMP runtime loaded: {sorted(gomp)}"
