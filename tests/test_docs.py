"""The docs' commands run in CI, and a newcomer can get from the README to every page.

Every fenced shell block in README.md and docs/*.md carries one mark after its language:
  ```bash runnable            run here, line by line (`shardopt` and `python` mean this interpreter);
  ```bash ci                  each command (`&&`-separated) is a line of .ci/run, which runs it;
  ```bash covered-by TEST...  each named test (tests/FILE.py::test_name) exists and runs the command
                              (with smaller sizes, or on the emulated cluster where the doc says NODE0).
A block without a mark fails: a command that nothing runs can break unnoticed.
"""
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
SHELLS = ("bash", "sh", "shell", "console")
MARKS = ("runnable", "ci", "covered-by")


def _blocks(page):
    """(line number, language, words after it, lines) of every fenced block of a page."""
    out, lines = [], open(os.path.join(ROOT, page)).read().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*(.*)$", lines[i])
        if m:
            indent, lang, info = m.groups()
            body, j = [], i + 1
            while j < len(lines) and lines[j].strip() != "```":
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
                j += 1
            out.append((i + 1, lang, info.split(), body))
            i = j + 1
            continue
        i += 1
    return out


def _shell_blocks():
    return [(page, *b) for page in PAGES for b in _blocks(page) if b[1] in SHELLS]


def _commands(body):
    """Shell commands of a block: continuation lines joined, comments dropped."""
    cmds, cur = [], ""
    for line in body:
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        cmds.append(re.sub(r"\s+#\s.*$", "", cur).strip())
        cur = ""
    return cmds


def test_every_shell_block_is_run_somewhere():
    blocks = _shell_blocks()
    assert len(blocks) >= 8, blocks  # the parser finds the docs' blocks
    bad = [f"{page}:{line}: ```{lang} {' '.join(info)}" for page, line, lang, info, _ in blocks
           if not info or info[0] not in MARKS or (info[0] == "covered-by" and len(info) < 2)]
    assert not bad, "shell blocks nothing runs (mark them runnable, ci or covered-by TEST):\n" + "\n".join(bad)


def test_covering_tests_exist():
    missing = []
    for page, line, _, info, _ in _shell_blocks():
        if info[0] != "covered-by":
            continue
        for node in info[1:]:
            path, _, name = node.partition("::")
            name = name.split("[")[0]
            full = os.path.join(ROOT, path)
            if not name or not os.path.isfile(full) or not re.search(rf"^def {re.escape(name)}\(",
                                                                       open(full).read(), re.M):
                missing.append(f"{page}:{line}: {node}")
    assert not missing, "covered-by names a test that does not exist:\n" + "\n".join(missing)


def test_ci_blocks_are_what_ci_runs():
    ci = {line.strip() for line in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()}
    blocks = [(page, line, body) for page, line, _, info, body in _shell_blocks() if info[0] == "ci"]
    assert blocks, "the README's two commands are marked ci"
    for page, line, body in blocks:
        for cmd in _commands(body):
            for part in cmd.split(" && "):
                assert part.strip() in ci, f"{page}:{line}: .ci/run does not run `{part.strip()}`"


RUNNABLE = [(page, line, cmd) for page, line, _, info, body in _shell_blocks() if info[0] == "runnable"
            for cmd in _commands(body)]


@pytest.mark.parametrize("page, line, cmd", RUNNABLE, ids=[f"{p}:{ln}" for p, ln, _ in RUNNABLE])
def test_runnable_commands_run(page, line, cmd):
    words = shlex.split(cmd)
    if words[0] == "shardopt":
        words = [sys.executable, "-m", "shardopt"] + words[1:]
    elif words[0] == "python":
        words = [sys.executable] + words[1:]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{page}:{line}: `{cmd}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{page}:{line}: `{cmd}` printed nothing"


def test_runnable_blocks_exist():
    assert RUNNABLE, "at least one command is run as the docs write it"


# ------------------------------------------------------------------ pages
def _slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page):
    text = open(os.path.join(ROOT, page)).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def test_readme_is_short_and_reaches_every_page():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(readme.splitlines()) <= 200, f"README.md has {len(readme.splitlines())} lines: move detail to docs/"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", readme))
    pages = {p for p in PAGES if p.startswith("docs")}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def test_links_point_at_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, page)).read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, dest)):
                broken.append(f"{page}: ({target}): no {dest}")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                broken.append(f"{page}: ({target}): no heading #{anchor} in {dest}")
    assert not broken, "\n".join(broken)


# The integrations whose oldest admitted versions CI tests, and the test files that use them.
_INTEGRATION_TESTS = {"transformers": ["tests/test_hf_trainer.py"], "accelerate": ["tests/test_hf_trainer.py"],
                      "lightning": ["tests/test_lightning.py", "tests/test_onebit.py"],
                      "deepspeed": ["tests/test_interop_deepspeed.py", "tests/test_onebit.py",
                                    "tests/test_hf_trainer.py"],
                      "trl": ["tests/test_trl.py"]}


def test_ci_tests_the_floors_setup_py_admits():
    """.ci/run's second venv installs exactly the oldest version setup.py admits of each integration and
    runs the tests that use it there: what is installed when a pytest line runs is what the install lines
    before it pinned, the later pin of a package winning (TRL's floor needs a newer accelerate than
    transformers', so its tests run after the others, on an install of their own)."""
    setup = open(os.path.join(ROOT, "setup.py")).read()
    floors = dict(re.findall(r'"(transformers|accelerate|lightning|deepspeed|trl)>=([0-9.]+)', setup))
    assert floors.keys() == _INTEGRATION_TESTS.keys(), floors
    pins, runs = {}, []
    for ln in open(os.path.join(ROOT, ".ci", "run")).read().splitlines():
        if ln.strip().startswith(".venv-oldest/bin/pip install"):  # ci_setup's indented too
            pins.update(re.findall(r"\b(transformers|accelerate|lightning|deepspeed|trl)==([0-9.]+)", ln))
        elif ln.startswith('PYTHONPATH="$PWD" .venv-oldest/bin/python -m pytest'):
            runs.append((ln.split(), dict(pins)))
    for name, files in _INTEGRATION_TESTS.items():
        for f in files:
            where = [installed for words, installed in runs if f in words]
            assert where, f"{f} ({name}) is not run in .venv-oldest by .ci/run"
            assert all(installed.get(name) == floors[name] for installed in where), (name, f, floors[name], where)
