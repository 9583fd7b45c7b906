"""The unity build's plan (Note [Unity build] in build_support/unity.py), checked without compiling.

That the units compile and the extension works is what every other test of the built extension checks;
here: how many units, which sources go together, and that a unit is rewritten only when it changes.
"""
import glob
import os
import re

from build_support.unity import plan_units, unit_count, unit_text, write_units

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_unit_count_follows_max_jobs_then_cpus_and_never_exceeds_sources():
    assert unit_count(None, 2, 21) == 2
    assert unit_count("4", 2, 21) == 4            # MAX_JOBS wins over the CPU count
    assert unit_count("", 3, 21) == 3
    assert unit_count("zero", 3, 21) == 3         # not a number: the CPUs
    assert unit_count("0", 3, 21) == 3
    assert unit_count(None, 64, 21) == 21         # as many CPUs as files: one file per unit
    assert unit_count(None, 0, 21) == 1
    assert unit_count("8", 2, 1) == 1


def test_plan_balances_bytes_keeps_every_source_once_and_is_deterministic():
    sizes = {"a.cpp": 100, "b.cpp": 60, "c.cpp": 50, "d.cpp": 10, "e.cpp": 40}
    units = plan_units(sizes, 2)
    assert sorted(p for u in units for p in u) == sorted(sizes)
    assert [sum(sizes[p] for p in u) for u in units] == [140, 120]
    assert units == [["a.cpp", "e.cpp"], ["b.cpp", "c.cpp", "d.cpp"]]   # each in path order
    assert plan_units(dict(reversed(sizes.items())), 2) == units
    assert plan_units(sizes, 1) == [sorted(sizes)]
    assert plan_units(sizes, 9) == [[p] for p in ["a.cpp", "b.cpp", "c.cpp", "e.cpp", "d.cpp"]]


def test_units_include_sources_by_absolute_path_and_are_rewritten_only_on_change(tmp_path):
    src = tmp_path / "x.cpp"
    src.write_text("int x;\n")
    [unit] = write_units([[str(src)]], str(tmp_path / "unity"))
    assert f'#include "{src}"' in open(unit).read()
    assert unit_text([str(src)]) == open(unit).read()
    os.utime(unit, (1, 1))
    write_units([[str(src)]], str(tmp_path / "unity"))
    assert os.stat(unit).st_mtime == 1                       # same text: untouched, ninja keeps its object
    write_units([[str(src), str(src)]], str(tmp_path / "unity"))
    assert os.stat(unit).st_mtime != 1


def test_no_two_sources_define_the_same_file_local_function():
    """Every generic source may share a unit with every other (one unit on one CPU): a helper defined
    twice in unnamed namespaces or as `static` would be a redefinition there. A cheap textual check of
    the functions and types defined at the start of a line in an unnamed namespace; the build is the full
    check."""
    isa = re.compile(r"\.(scalar|avx2|avx512|neon)\.cpp$")
    seen = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True)):
        if isa.search(path) or os.sep + "tests" + os.sep in path:
            continue
        depth, names = 0, set()
        for line in open(path, encoding="utf-8"):
            if re.match(r"namespace \{", line):
                depth += 1
            elif depth and re.match(r"\}  // namespace\s*$", line):
                depth -= 1
            m = re.match(r"(?:static\s+)?(?:inline\s+)?[\w:<>,\s\*&]+?\b(\w+)\(", line)
            if m and (depth or line.startswith("static ")) and not line.startswith((" ", "\t", "return")):
                names.add(m.group(1))
            t = re.match(r"(?:struct|class)\s+(\w+)\s*[:{]", line)  # a type in an unnamed namespace clashes too
            if t and depth:
                names.add(t.group(1))
        for name in names:
            assert name not in seen, f"{name} is defined file-locally in both {seen[name]} and {path}: rename one"
            seen[name] = path
