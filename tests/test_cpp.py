"""The C++ tests of csrc/tests/, built and run by CMake/CTest from this test (issue 58: they were registered
with CTest only, and nothing ran them).

Note [The C++ tests run from pytest]
------------------------------------
CI runs exactly the README's test command (`python -m pytest -q tests`), and so does a developer; a step of
its own in `.ci/run` would run them in CI only. So this test configures CMakeLists.txt in a fresh build
folder (without the Python module: setup.py builds that; the C++ tests need the ISA kernels and
cpu_features only), builds every target that is left, and runs `ctest`. It fails when a C++ test fails, when
one does not build, and when a file of csrc/tests/ is not registered with CTest. The C++ Adam test runs every
SIMD variant the CPU runs (csrc/cpu_features.cpp's supported_isas()); the test checks that list against
tests/isa_variants.py's reading of /proc/cpuinfo, so a variant the build leaves out fails here too.
About 20 s on a 2-core machine (configure 7 s, build 10 s of compiler time, the tests 1 s).

cmake comes with the test extras (setup.py: `pip install -e '.[test]'` puts it beside the Python that runs
the tests), or from the system; ninja when there is one, else make.
"""
import os
import re
import shutil
import subprocess
import sys

import torch

import isa_variants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP_TESTS = os.path.join(ROOT, "csrc", "tests")


def _tool(name):
    """`name` beside this Python (the venv's bin/, where pip puts cmake and ninja), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-6000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    return proc.stdout


def _registered():
    """csrc/tests/ files CMakeLists.txt builds into an executable that add_test runs."""
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        text = f.read()
    exes = dict(re.findall(r"add_executable\((\w+)\s+csrc/tests/([\w.]+\.cpp)", text))
    tested = set(re.findall(r"add_test\(NAME\s+\w+\s+COMMAND\s+(\w+)", text))
    return {src for exe, src in exes.items() if exe in tested}


def test_every_cpp_test_is_registered_with_ctest():
    files = {f for f in os.listdir(CPP_TESTS) if f.endswith(".cpp")}
    assert files, "csrc/tests/ holds no C++ test"
    assert files <= _registered(), f"not run by CTest (add_executable + add_test in CMakeLists.txt): " \
                                   f"{sorted(files - _registered())}"


def test_cpp_tests_pass(tmp_path):
    # Note [The C++ tests run from pytest]
    cmake, ninja = _tool("cmake"), _tool("ninja")
    assert cmake, "the C++ tests need cmake >= 3.18 (pip install cmake, or the test extras: pip install -e '.[test]')"
    build = str(tmp_path / "build")
    configure = [cmake, "-S", ROOT, "-B", build, "-DSHARDOPT_BUILD_PYTHON_MODULE=OFF",
                 f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DPython3_EXECUTABLE={sys.executable}"]
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    _run(configure)
    _run([cmake, "--build", build, "-j", str(os.cpu_count() or 1)])
    ctest = os.path.join(os.path.dirname(cmake), "ctest")
    out = _run([ctest if os.access(ctest, os.X_OK) else "ctest", "--test-dir", build, "--output-on-failure",
                "-V"])
    # ctest's summary: "100% tests passed, 0 tests failed out of N" (cmake 3.x), "100% tests passed out of N"
    # (cmake 4.x, as pip's cmake is); _run already failed on a non-zero exit (any test failed).
    summary = re.search(r"100% tests passed(?:, 0 tests failed)? out of (\d+)", out)
    assert summary, f"no ctest summary of all tests passing:\n{out}"
    assert int(summary.group(1)) == len(_registered()), out
    # The Adam test prints one "<variant> ok" line per variant it ran: every one this CPU runs.
    ok = set(re.findall(r"^\d+: (\w+)\s+ok$", out, re.M))
    assert ok == set(isa_variants.runnable()), f"variants run {sorted(ok)}, this CPU runs " \
                                               f"{isa_variants.runnable()}:\n{out}"
