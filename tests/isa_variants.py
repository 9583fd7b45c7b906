"""Which SIMD variants of shardopt's CPU kernels this machine can run, worked out without the extension, and
what the suite ran under each (reported by conftest.py's terminal summary).

The extension picks a variant once per process (csrc/cpu_features.cpp: SHARDOPT_ISA is read at the first
kernel call; `_C.set_isa_override` switches it in-process, but only in that process, not in ranks forked
from the launcher's server), so the kernel-sensitive tests (marked `isa_kernels`) run under the process's
own variant, and tests/test_isa_variants.py runs them again in a subprocess with SHARDOPT_ISA set, once
per other variant this CPU can run. Which variants a CPU can run is read here from /proc/cpuinfo with the
rules of cpu_features.cpp's cpu_runs(), not from the extension, so that a variant the extension failed to
offer fails a test (test_isa_variants.py) instead of silently never running.
"""
from __future__ import annotations

import os
import platform

MARK = "isa_kernels"
# SHARDOPT_TEST_ISA_REPORT=<path>: conftest.py writes what this process ran under which variant there
# (the per-variant pass reads it back).
REPORT_ENV = "SHARDOPT_TEST_ISA_REPORT"

# Every variant setup.py builds for an architecture (Note [ISA translation units] in setup.py), with the
# CPU flags cpu_runs() needs for it (aarch64's Advanced SIMD is baseline: no flag).
_BUILT = {
    "x86_64": {"scalar": (), "avx2": ("avx2", "fma", "f16c"),
               "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq")},
    "aarch64": {"scalar": (), "neon": ()},
}
_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}

# Filled in by tests/test_isa_variants.py: variant -> (passed: bool, what it ran, in words).
PASSES: dict[str, tuple[bool, str]] = {}


def arch() -> str:
    return _ARCH.get(platform.machine().lower(), platform.machine().lower())


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on arm); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def variants() -> dict[str, str | None]:
    """Every variant built for this architecture -> None if this CPU runs it, else why not (in words)."""
    flags = cpu_flags()
    out = {}
    for name, needs in _BUILT.get(arch(), {"scalar": ()}).items():
        missing = [f for f in needs if f not in flags]
        out[name] = f"CPU lacks {', '.join(missing)}" if missing else None
    return out


def runnable() -> list[str]:
    return [name for name, why in variants().items() if why is None]


def kernel_test_files(tests_dir: str) -> list[str]:
    """The test files with tests marked isa_kernels (whole files set `pytestmark`), this helper's own user
    excluded."""
    out = []
    for name in sorted(os.listdir(tests_dir)):
        if name.startswith("test_") and name.endswith(".py") and name != "test_isa_variants.py":
            with open(os.path.join(tests_dir, name)) as f:
                if f"mark.{MARK}" in f.read():
                    out.append(os.path.join(tests_dir, name))
    return out
