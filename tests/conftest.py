import json
import os
import sys

# Spawned ranks import test modules by name; make tests/ importable for them.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import isa_variants  # noqa: E402

# Kernel-sensitive tests (marked isa_kernels) in this session, by outcome; "collected" counts those selected.
_KERNEL_TESTS = {"collected": 0, "passed": 0, "failed": 0, "skipped": 0}
_VARIANT_PASSES = [0]  # tests of tests/test_isa_variants.py's per-variant pass selected in this session


def pytest_collection_modifyitems(session, config, items):
    _KERNEL_TESTS["collected"] = sum(1 for item in items if item.get_closest_marker(isa_variants.MARK))
    _VARIANT_PASSES[0] = sum(1 for item in items if "test_isa_variants.py::" in item.nodeid)


def pytest_runtest_logreport(report):
    if isa_variants.MARK not in report.keywords:
        return
    # A test's outcome: its call, or a setup that failed or skipped, or a teardown that failed.
    if report.when == "call" or (report.when == "setup" and not report.passed) or \
            (report.when == "teardown" and report.failed):
        _KERNEL_TESTS[report.outcome] += 1


def _active_isa():
    import shardopt

    return shardopt.cpu_features()["active"]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(isa_variants.REPORT_ENV)
    if path:  # a per-variant pass (tests/test_isa_variants.py) reads what ran under which variant
        with open(path, "w") as f:
            json.dump(dict(_KERNEL_TESTS, active=_active_isa(), forced=os.environ.get("SHARDOPT_ISA")), f)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line: the SIMD variants the kernel-sensitive tests ran under, and the ones they did not, with why."""
    if not _KERNEL_TESTS["collected"] and not _VARIANT_PASSES[0]:
        return
    ran = {}
    done = _KERNEL_TESTS["passed"] + _KERNEL_TESTS["failed"]
    if done:
        ran[_active_isa()] = f"this process: {_KERNEL_TESTS['passed']} passed" + \
            (f", {_KERNEL_TESTS['failed']} FAILED" if _KERNEL_TESTS["failed"] else "")
    for name, (ok, words) in isa_variants.PASSES.items():
        ran.setdefault(name, words if ok else f"FAILED: {words}")
    active, not_run = _active_isa(), []
    for name, why in isa_variants.variants().items():
        if name in ran:
            continue
        if why is None:  # runnable: a test selection left it out
            why = "this CPU runs it; " + ("no test marked isa_kernels ran in this process" if name == active
                                          else "its pass in tests/test_isa_variants.py was not selected")
        not_run.append(f"{name} ({why})")
    line = "ISA variants: ran " + (", ".join(f"{k} ({v})" for k, v in ran.items()) or "none")
    line += "; not run: " + (", ".join(not_run) or "none")
    terminalreporter.write_sep("-", "SIMD variants of the CPU kernels")
    terminalreporter.write_line(line)
