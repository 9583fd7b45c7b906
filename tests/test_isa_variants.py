"""The kernel-sensitive tests under every SIMD variant this CPU can run, not only the one it picks.

A process runs one variant of the CPU kernels (the best, or SHARDOPT_ISA's; read once, at the first kernel
call, by csrc/cpu_features.cpp), and its ranks inherit it, so the tests marked `isa_kernels` (the fused
Adam and the int8 codec against their references and torch.optim, in-process and in ranks) run in this
process under its variant and here, in a subprocess with SHARDOPT_ISA set, under each other variant this
CPU runs: on an AVX-512 machine scalar and avx2, on AVX2 scalar, on aarch64 scalar. Which variants the CPU
runs is read from /proc/cpuinfo (tests/isa_variants.py), not from the extension, so one it fails to offer
fails here; the terminal summary says which variants ran and which could not, and why (conftest.py).
"""
import json
import os
import subprocess
import sys

import pytest

import isa_variants
import shardopt

HERE = os.path.dirname(os.path.abspath(__file__))
ACTIVE = shardopt.cpu_features()["active"]
OTHERS = [v for v in isa_variants.runnable() if v != ACTIVE]


def test_the_extension_offers_every_variant_this_cpu_runs():
    # test_isa.py and test_int8_codec.py force the variants the extension offers; one it left out (a
    # detection or build bug) would never run anywhere, and nothing else would say so.
    assert shardopt.cpu_features()["supported"] == isa_variants.runnable(), (
        shardopt.cpu_features(), isa_variants.variants())
    assert ACTIVE in isa_variants.runnable() and set(OTHERS) | {ACTIVE} == set(isa_variants.runnable())
    forced = os.environ.get("SHARDOPT_ISA")
    assert ACTIVE == (forced or isa_variants.runnable()[-1])


def test_kernel_tests_are_found():
    files = {os.path.basename(f) for f in isa_variants.kernel_test_files(HERE)}
    assert {"test_isa.py", "test_int8_codec.py", "test_cpu_adam.py", "test_onebit.py"} <= files, files


@pytest.mark.parametrize("isa", OTHERS)
def test_kernel_tests_pass_under_every_other_variant(isa, tmp_path):
    report = tmp_path / "ran.json"
    env = dict(os.environ, SHARDOPT_ISA=isa, **{isa_variants.REPORT_ENV: str(report)})
    files = isa_variants.kernel_test_files(HERE)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", isa_variants.MARK, *files]
    proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=600)
    ran = json.loads(report.read_text()) if report.exists() else {}
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    ok = proc.returncode == 0 and ran.get("active") == isa and ran.get("failed") == 0 \
        and ran.get("passed", 0) > 0 and ran.get("passed") + ran.get("skipped") == ran.get("collected")
    isa_variants.PASSES[isa] = (ok, f"SHARDOPT_ISA={isa} subprocess: {ran.get('passed', 0)} passed"
                                    + (f", {ran['skipped']} skipped" if ran.get("skipped") else ""))
    assert proc.returncode == 0, f"SHARDOPT_ISA={isa}: {' '.join(cmd)}\n{tail}"
    # The variant really was the one used (SHARDOPT_ISA not ignored), and the kernel tests ran, all of them.
    assert ran.get("active") == isa, (ran, tail)
    assert ran["passed"] > 0 and ran["failed"] == 0 and ran["passed"] + ran["skipped"] == ran["collected"], ran
