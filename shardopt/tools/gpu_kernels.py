"""gpu_check's kernel part: every torch.ops.shardopt op with a kernel on the device against its reference.

The ops come from the dispatcher: every `shardopt::` op must have a check (KERNEL_CHECKS) or be CPU_ONLY.
An unknown op, a CPU-only op with a device kernel, or a checked op without one (a CPU-only build) fails,
naming what to do.
"""
from __future__ import annotations

import dataclasses
import importlib
import math

import torch

# Empty, one element, an odd tail, several blocks, and more elements than csrc/cuda/unscale.cu launches
# threads (~1.1M on an H100), so the grid-stride loop goes round more than once.
SIZES = (0, 1, 17, 100_003, 3 * 2**20 + 5)
QUICK_SIZES = (0, 1, 17, 4099)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# 3.0 and 0.1 do not divide exactly; 2**17 is a loss scale.
DIVISORS = (1.0, 3.0, 0.1, 2.0**17)


@dataclasses.dataclass(frozen=True)
class KernelResult:
    op: str
    status: str
    """"pass", "FAIL" or "CPU only"."""
    cases: int
    """Calls of the op that were compared with the reference."""
    detail: str = ""
    """Why it failed (the first differences), or what a CPU-only op is for."""


def check_unscale_into(dev: torch.device, sizes=SIZES, op=None) -> tuple[int, list[str]]:
    """shardopt::unscale_into on `dev` against unscale_into_reference on CPU: (cases, failures). Bit for bit
    (Note [Unscale rounding] in csrc/precision/unscale_element.h), every dtype pair, in place too; the inf/nan
    flag raised by any non-finite source element, never by the destination's old contents, never cleared."""
    from shardopt.reference import unscale_into_reference

    op = op or torch.ops.shardopt.unscale_into
    cases, failures = 0, []

    def run(src, dst_dtype, divisor, found_before=0.0, dst_fill=0.0):
        got = torch.full((src.numel(),), dst_fill, dtype=dst_dtype, device=dev)
        found = torch.full((1,), found_before, device=dev)
        op(src.to(dev), got, divisor, found)
        want, want_found = torch.empty(src.numel(), dtype=dst_dtype), torch.full((1,), found_before)
        unscale_into_reference(src, want, divisor, want_found)
        return got.cpu(), found.item(), want, want_found.item()

    for src_dtype in DTYPES:
        for dst_dtype in DTYPES:
            pair = f"{_name(src_dtype)}->{_name(dst_dtype)}"
            for n in sizes:
                # Drawn in fp64, so an fp64 source has bits fp32 would round away.
                src = (torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 50)
                src = src.to(src_dtype)
                for divisor in DIVISORS:
                    got, found, want, _ = run(src, dst_dtype, divisor, dst_fill=math.nan)
                    cases += 1
                    if not torch.equal(got, want):
                        failures.append(f"{pair} n={n} divisor={divisor}: {_diff(got, want)}")
                    if found != 0.0:
                        failures.append(f"{pair} n={n}: inf/nan flag raised on finite input (or by dst's old nan)")
                for at in sorted({0, n // 2, n - 1}) if n else ():
                    for bad in (math.inf, -math.inf, math.nan):
                        poisoned = src.clone()
                        poisoned[at] = bad
                        _, found, _, want_found = run(poisoned, dst_dtype, 2.0)
                        cases += 1
                        if found != want_found or found != 1.0:
                            failures.append(f"{pair} n={n}: {bad} at {at} not flagged (flag {found})")
                if n:
                    _, found, _, _ = run(src, dst_dtype, 2.0, found_before=1.0)
                    cases += 1
                    if found != 1.0:
                        failures.append(f"{pair} n={n}: a raised flag was cleared by a clean call")
    # In place: stage 1 unscales its flat gradient buffer where it lies.
    for dtype in (torch.float32, torch.bfloat16):
        t = (torch.randn(1000, generator=torch.Generator().manual_seed(7)) * 50).to(dtype)
        want = torch.empty_like(t)
        unscale_into_reference(t, want, 3.0, torch.zeros(1))
        on_dev = t.to(dev)
        op(on_dev, on_dev, 3.0, torch.zeros(1, device=dev))
        cases += 1
        if not torch.equal(on_dev.cpu(), want):
            failures.append(f"in place {_name(dtype)}: {_diff(on_dev.cpu(), want)}")
    return cases, failures


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    differ = ~((got == want) | (got.isnan() & want.isnan()))
    idx = differ.nonzero().flatten()
    if not idx.numel():
        return "same values, different dtype or shape"
    i = int(idx[0])
    return f"{idx.numel()} of {got.numel()} elements differ, first at {i}: {got[i].item()!r} vs {want[i].item()!r}"


# op -> its check: check(dev, sizes) -> (cases, failures)
KERNEL_CHECKS = {"shardopt::unscale_into": check_unscale_into}
# op -> what it is, for ops that have no kernel but the CPU one
CPU_ONLY = {"shardopt::adam_step": "the fused CPU Adam (offload steps on the host)",
            "shardopt::stream_limit": "the CPU Adam's bandwidth yardstick"}


def shardopt_ops() -> list[str]:
    """Every op registered under TORCH_LIBRARY(shardopt) (csrc/ops.cpp)."""
    importlib.import_module("shardopt")  # loading the extension registers them
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("shardopt::"))


def check_kernels(device, dev: torch.device, sizes=SIZES, ops=None, checks=None, cpu_only=None) -> list[KernelResult]:
    """One KernelResult per shardopt op (see the module's docstring for the rules)."""
    ops = shardopt_ops() if ops is None else ops
    checks = KERNEL_CHECKS if checks is None else checks
    cpu_only = CPU_ONLY if cpu_only is None else cpu_only
    out = []
    for op in ops:
        key = device.dispatch_key
        if op in checks:
            if not device.has_kernel(op):
                out.append(KernelResult(op, "FAIL", 0, f"no {key} kernel: shardopt._C was built without CUDA. "
                                        "Rebuild it against a CUDA torch with nvcc found: "
                                        "pip install --no-build-isolation -e ."))
                continue
            try:
                cases, failures = checks[op](dev, sizes)
            except Exception as e:  # noqa: BLE001 - a crashing kernel is a failed check, the others still run
                out.append(KernelResult(op, "FAIL", 0, f"raised {type(e).__name__}: {e}"))
                continue
            out.append(KernelResult(op, "FAIL" if failures else "pass", cases,
                                    "; ".join(failures[:5]) + (f"; ... {len(failures)} in all" if len(failures) > 5
                                                               else "")))
        elif op in cpu_only:
            if key != "CPU" and device.has_kernel(op):
                out.append(KernelResult(op, "FAIL", 0, f"has a {key} kernel now, but gpu_check has no check for "
                                        "it: add one to KERNEL_CHECKS in shardopt/tools/gpu_kernels.py"))
            else:
                out.append(KernelResult(op, "CPU only", 0, cpu_only[op]))
        else:
            out.append(KernelResult(op, "FAIL", 0, "an op gpu_check does not know: add its check to KERNEL_CHECKS "
                                    "(against its reference in shardopt/reference.py), or add it to CPU_ONLY, in "
                                    "shardopt/tools/gpu_kernels.py"))
    return out
